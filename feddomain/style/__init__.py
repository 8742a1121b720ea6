"""Style statistics and style transfer shared by FISC, CCST and (for FINCH) FPL.

``backends``: the encoder/decoder pairs that style transfer runs through (the weight-free
block-DCT ``adain_dct`` by default, AdaIN's VGG-19 from local weight files); ``statistics``:
AdaIN, per-cluster moments, a client's style (FINCH clusters weighted equally) and the server's
interpolation style (median of FINCH cluster means).
"""
