"""The query side: lineage walks, the query language, the versions table, diff and history. Never uses
the Store facade.
"""
