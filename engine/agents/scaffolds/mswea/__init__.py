"""Files that run *inside* mini-swe-agent's process: the folder alone is on its
``PYTHONPATH``, so these modules import only the standard library and ``minisweagent``."""
