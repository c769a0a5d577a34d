"""The monitors' evaluation on real instabilities (docs/monitors.md, "Measured on real
instabilities"): ``instability.py`` runs the cases of ``cases.yaml`` on the data ``data.py`` builds,
with the configs in ``configs/experiment/``.

It lives here, not in tools/bench/ (it measures what the monitors catch, not speed) nor in
tools/evaluate/ (the installed ``earlyfuse-eval`` a user runs on a model): like the benchmarks it
is a script of a checkout, left out of the installed distribution (pyproject.toml), and its
configs sit beside it rather than among the user's presets in configs/.
"""
