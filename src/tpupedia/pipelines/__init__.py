"""Text-to-video pipelines in stages: `cogvideox` (notebook 06), with the stage-file contract in
`stages` and scheduler steps as pure functions in `schedulers`."""
