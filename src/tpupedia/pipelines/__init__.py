"""Text-to-video pipelines in stages: `cogvideox` (notebook `cogvideox_pipeline`) and `hunyuan` (notebook `hunyuan_video`) on
what they share in `common` (requests, validation, the stage runner), with the stage-file
contract in `stages`, scheduler steps as pure functions in `schedulers` (CogVideoX's DDIM and
DPM solvers, the flow-match Euler step of HunyuanVideo-1.5) and DeepCache's schedule and
quality metrics in `deepcache`."""
