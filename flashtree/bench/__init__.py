"""`flashtree bench`: decode speed on this GPU against its ceilings and the peers.

`cli` parses the command line and runs the measurements, `presets` names the published shapes
(which `flashtree plan --preset` plans too), `models` builds random-weight pairs of them,
`measure` times them through the engine's decoder, `peers` runs the other implementations in
their own processes, `report` renders the markdown tables. Nothing is imported here: `flashtree
plan`'s parser reads `presets` (torch-free), the rest is imported only when `bench` runs.
"""
