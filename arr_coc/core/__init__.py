"""The ARR-COC layer: its four stages, and what only they use.

    texture.py     stage 1, the texture array: every cell of the merged-token grid described in channels, with its
                   helpers spectral.py (spectral-residual saliency), kmeans.py (colour clusters) and components.py
                   (connected components, the object channels)
    knowing.py     stage 2, the three ways of knowing: information, perspectival and participatory scorers
    balancing.py   stage 3, the tension balancer: how much each scorer counts, per image and question
    attending.py   stage 4, the allocator: a relevance map and a budget -> the visual tokens kept
    layer.py       ARRCOCLayer, the four stages in order (decide on the device, read back once)
    config.py      ARRCOCConfig, every number of every stage; output.py: ARRCOCOutput, what the layer decided
    grid.py        the batch's geometry on the merged grid (padded frames, masks): the stages' data type, which
                   a backend also builds and reads (qwen/, pipeline/)
    batch.py       LayerBatch, what the layer reads for one batch; extent.py: how many cells a question needs
    temporal.py    what only a clip has: motion, scene cuts, relevance carried over time, a budget spread over its
                   temporal groups
    persistence.py a trained layer's files (config.json, model.safetensors, the model card), folder or hub

The core imports nothing above it: no pipeline, backend, method or entry point (tests/test_structure.py).
Nothing is imported here, so `arr_coc.core.config` loads without torch.
"""
