"""Text-to-video pipelines in stages: `cogvideox` (notebook `cogvideox_pipeline`) and `hunyuan` (notebook `hunyuan_video`) on
what they share in `common` (requests, validation, the stage runner), with the stage-file
contract in `stages`, scheduler steps as pure functions in `schedulers` (CogVideoX's DDIM and
DPM solvers, the flow-match Euler step of HunyuanVideo-1.5) and the step caches every family
takes (DeepCache, First-Block-Cache, MagCache: static schedules, two compiled programs) in
`stepcache`, DeepCache's names kept in `deepcache`."""
