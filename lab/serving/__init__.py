"""The serving parts studied in the serving notebook: the audio feature cache, keyframe infill, the INT8
key/value cache, the three-stream pipeline, the low-resolution cascade and WebSocket streaming."""
