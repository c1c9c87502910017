"""Files that run *inside* mini-swe-agent's process, not the engine's.

The folder is put on the scaffold's ``PYTHONPATH`` on its own, so these modules import only the
standard library and ``minisweagent``; nothing of the engine is loaded into the scaffold.
"""
