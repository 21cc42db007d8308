"""A module only the driver can import (its folder is on the driver's PYTHONPATH, not next to the job file)."""


def bump(ws):
    ws["x"] = ws["x"] + 1
