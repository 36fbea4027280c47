"""The compat layer: every private name of torch, diffusers and transformers that magi_zoo
uses lives here, one module per library (`compat.torch`, `compat.diffusers`,
`compat.transformers`), each use with a one-line why and the versions it was checked on.

Nothing outside this package may import a private module or read a private attribute of
those three libraries (`tests/project/test_structure.py` walks the tree and fails on one).
When a library release moves a private name, the fix is here and nowhere else.
"""
