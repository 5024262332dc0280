"""Maintenance: flushing to cold, refresh from other hosts, eviction, fsck, retention and gc. Never
uses the Store facade.
"""
