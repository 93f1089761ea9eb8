"""ARR-COC: query-aware visual-token allocation for Qwen-VL models.

    from arr_coc import ARRCOCConfig, ARRCOCLayer
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(1536))
    out = layer(images, grid_hw, query_embeds=..., visual_tokens=..., budget=0.25)
    out.kept_indices   # per image, raster indices of the visual tokens to keep
"""

from .config import ARRCOCConfig
from .layer import ARRCOCLayer, ARRCOCOutput
from .texture import channel_names, generate_texture_array

__all__ = ["ARRCOCConfig", "ARRCOCLayer", "ARRCOCOutput", "channel_names", "generate_texture_array"]


def __getattr__(name: str):
    # The VLM wrapper pulls in transformers; import it only when asked for.
    if name in ("ARRCOCQwen", "Trace"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'arr_coc' has no attribute {name!r}")
