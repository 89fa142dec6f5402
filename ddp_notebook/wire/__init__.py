"""The messages between the notebook and its ranks: plain, typed values, standard library only.

Both sides import these; neither side's modules are imported here.
"""
