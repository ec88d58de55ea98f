"""`c2w bench`: the runtime measured as a serving process uses it (docs/architecture.md says why
it sits on the toolchain side): `engines` times each key's engine against eager and whole
streaming chunks, and writes the calibration the planner reads; `serving` drives many
concurrent streams through one StreamServer (`c2w bench --serve`)."""
