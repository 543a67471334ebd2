"""talking-head lab: make audio-driven talking-head models run fast without losing quality."""

__version__ = "0.1.0"
