"""Worked examples of docs/howto/add-policy.md: one short file per policy, each built on the base
that fits it. They are not registered here (``tests/test_policy_extension.py`` registers them for
its tests): shipping a policy means measuring it into the shipped policy profile."""
