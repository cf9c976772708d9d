"""Two cheap points over configs/default.py:debug (tests and a smoke check of the runner).

./launch.sh sweep experiments/default_smoke.py
"""

CONFIG = "configs/default.py:debug"
NAME = "default_smoke"


def sweep() -> list[dict]:
    return [{"model.dropout_rate": 0.0}, {"model.dropout_rate": 0.1}]
