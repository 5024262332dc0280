"""The object layer: chunks, pack files, tiers and the object store that reads across them. Knows
nothing of versions, refs or torch.
"""
