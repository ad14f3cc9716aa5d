"""Published numbers of the reproduced papers (data only), installed as ``kvbench.papers_data``.

One YAML file per paper; ``kvbench.papers`` loads and validates them. This file only makes the folder
an importable package, so ``pip install .`` ships the YAML files like ``kvbench.conf``.
"""
