"""Visual environments: observations with images (`tiderl.envs.protocol.Observation`).
visual_grid (a grid world seen as an image, `grid.py`) and visual_table (a bar chart and SQL,
`table.py`); docs/env_visual.md."""
