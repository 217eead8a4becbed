"""VarRate: every token kept in HBM, anchors and a recent window exact, the rest coded at a
per-token rank on a per-layer basis (``../shared/spec/varrate.md``).

``policy`` (``varrate`` and its ``flat`` ablation), ``codec`` (the per-layer code),
``calibrate`` (per-layer bases from calibration traces, and their files)."""

from kvsim.policies.varrate import policy  # noqa: F401  (registers "varrate" and "flat")
