"""The ARR-COC microscope: a Gradio app that runs the baseline VLM and the ARR-COC VLM side by side.

    inputs    upload reading and normalising, question / budget / method checks, InputError
    handler   one request (`ask`): both runs, the stats rows, the trace record, the files it writes
    page      the Gradio Blocks layout, its CSS and examples (`build_demo`)
    memory    glibc malloc tuning that keeps the server's resident memory flat
    server    command-line arguments, loading the model (`load` -> `Microscope`), `serve`, `main`

`app.py` at the repository root is the entry point (`python app.py`, `make run`, a Hugging Face
Space). Importing any of these modules loads neither torch, transformers nor gradio.
"""
