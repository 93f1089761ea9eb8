"""The ARR-COC microscope: a Gradio app that runs the baseline VLM and two pruned configurations side by side.

    inputs    the library's input validator (arr_coc.validation) plus the app's own upload cases, InputError
    configs   configs A and B of a request (method, layer, encode after|before) and the layers offered
    asked     what a request asks about: an image or a clip, opened and checked, one picture per unit
    handler   one request (`ask`), image or clip: the baseline and each config's run, the files it writes
    pictures  relevance, scorer maps, texture channels, what was encoded at which resolution (a clip: per group)
    readout   the tokens/time/FLOPs table and the JSON trace record (FLOPs: arr_coc.evaluation.cost)
    admission how much work is taken on at once (requests, image pixels): "busy, try again" beyond it
    lifetime  a client's cancel or disconnect -> the request's CancelToken (its model work stops)
    page      the Gradio Blocks layout, its CSS and examples (`build_demo`)
    memory    glibc malloc tuning that keeps the server's resident memory flat
    server    command-line arguments, loading the model (`load` -> `Microscope`), `serve`, `main`

`app.py` at the repository root is the entry point (`python app.py`, `make run`, a Hugging Face
Space). Importing any of these modules loads neither torch, transformers nor gradio.
"""
