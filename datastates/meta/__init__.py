"""Metadata: the LMDB catalog, refs (branches, tags), version records and the version graph."""
