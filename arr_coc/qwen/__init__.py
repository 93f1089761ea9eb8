"""The Hugging Face Qwen-VL backend (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), registered for the front door `arr_coc.ARRCOC`.

backend.py      QwenBackend: the pipeline's `VLMBackend` core and every capability, for these models
wrapper.py      ARRCOCQwen: the front door with a Qwen model's names (a thin alias of `arr_coc.ARRCOC`)
families.py     what differs between the three families, one entry each
prompt.py       the prompt read as units: pads, patch rows, unpruned M-RoPE positions
pixels.py       the processor's patches as the texture's input
encoding.py     the tower on chosen cells at their true positions, the gist
rewrite.py      the kept tokens at their original positions (PrunedInputs)
attention.py    FastV's and VisionZip's attention, as the backend's services
tower_memory.py a later look's tower attends to earlier looks' keys and values
processing.py   chat prompts (questions tokenized as plain text), the image-only processor, un-patchify
loading.py      checkpoints (hub id or folder); `ENTRY`, this backend's entry in `arr_coc.pipeline.registry`
video_processor.py  Qwen-VL's video processor in torch alone (clips -> pixel_values_videos, video_grid_thw)
visuals.py      `LaysOutVisuals`: a batch's visuals and the image scale, read from the processor's tensors
train_inputs.py what training keeps of a prompt (`answer_prompts`) and the model's content hash
tiny.py         tiny random models of the three families, for tests
scratch.py      QwenScratch: the registry's `FromScratch` (the test bed's word-level model, the bench's random models)
"""

from ..pipeline.choose import SelectorFailed
from ..pipeline.trace import PrefillOutput, Trace
from .backend import QwenBackend
from ..pipeline.registry import HubUnreachable
from .loading import MODEL_CLASSES
from .rewrite import PrunedInputs
from .wrapper import ARRCOCQwen

__all__ = ["ARRCOCQwen", "HubUnreachable", "MODEL_CLASSES", "PrefillOutput", "PrunedInputs", "QwenBackend",
           "SelectorFailed", "Trace"]
