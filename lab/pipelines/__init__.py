"""End-to-end engines composed from lab.models, lab.audio, lab.video and lab.accel."""
