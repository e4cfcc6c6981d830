"""The conversion and compression methods, one folder each, over the shared layers.

- `cmoe`: CMoE carving of dense FFNs (shared + routed experts, analytical router).
- `hierarchical`: CMoE applied to each expert of an existing MoE (sub-experts).
- `expertweaver`: ExpertWeaver (GLU gate profiles, adaptive shared experts) and downcycling.
- `conmoe`: ConMoE expert-pool consolidation and its pruning/merging baselines.

Each exports a `METHOD` (`method.py`: its flags, settings, checks and job steps), listed in
`registry.py`, from which the convert and compress commands are built
(docs/guides/adding-a-method.md).
"""
