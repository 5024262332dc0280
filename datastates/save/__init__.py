"""The save path: state tree, stats, manifests, capture into reused buffers, the pipeline, and the
commit that makes a version visible.
"""
