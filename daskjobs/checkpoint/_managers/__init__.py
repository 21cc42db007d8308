"""The public faces of checkpoints: managers that save and load node workspaces as task groups and
commit epochs (:mod:`.manager`, with :mod:`.nodes`, :mod:`.loads` and :mod:`.resumes` mixed in),
metadata handlers, upload builders, and read-only views of committed checkpoints;
and behind a manager's ``writing``, the commit pipeline a run saves and commits its epochs through
(:mod:`.pipeline`, taking the hooks' reports and committing in :mod:`.commits`, with each save and
commit in :mod:`.writer`, its bookkeeping in :mod:`.ledger` and what it says to the runner in
:mod:`.saving`).

Imports every other part of :mod:`daskjobs.checkpoint`; nothing in the package imports it except
the package's ``__init__``.
"""
