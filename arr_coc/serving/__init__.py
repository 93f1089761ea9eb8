"""ARR-COC where VLMs are served: serving-engine plugins built on the pure choice (`arr_coc.choose`).

`arr_coc.serving.vllm`: the out-of-tree vLLM plugin (docs/SERVING.md). Importing this package imports no engine.
"""
