"""What the notebook shows while a cell runs: the feed of the ranks' metrics and progress, the
widget and text views of it, stragglers named from step times, the X-ray's readings, ranks
grouped by what they say. Imports neither `cell/` nor `world/`."""
