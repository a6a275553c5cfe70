"""Facts about traced graphs, one copy each, shared by the passes, the capture checks and `explain`:

    values.py     a node's fake value, level, user source line, input name
    effects.py    which memory each node's value lives in and which it writes; randomness
    selection.py  selections (topk, max/min, argmax/argmin) in every spelling
"""
