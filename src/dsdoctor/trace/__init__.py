"""``dsdoctor trace`` and ``dsdoctor ab``: observe the user's own DeepSpeed run, rank by rank.

Data flow: ``launch`` runs the user's command with ``observer/`` on PYTHONPATH -> every rank writes a
JSON-lines record (``observer/recorder.py``) -> ``records`` reads them back -> ``report`` turns them into a
``TraceResult`` with findings -> ``diagnose_ab`` compares variants into an ``AbResult``.
"""
