"""`flashtree bench`: decode speed on this GPU against its ceilings and the peers.

`cli` parses the command line and runs the measurements, `models` builds random-weight pairs of
the published shapes (checkpoint.presets, which `flashtree plan --preset` plans too),
`measure` times them through the engine's decoder, `sessions` times several sequences' steps
in turn against shared (--sessions), `peers` runs the other implementations in their own
processes, `report` renders the markdown tables. Nothing is imported here: the rest
is imported only when `bench` runs.
"""
