"""The one validator of what a user sends, one module per concern:

    limits.py    InputLimits / LIMITS: what is accepted (every refusal quotes the limit it applied); limits_for
    images.py    an image: opened, its header checked before decoding, then decoded and normalised (`check_image`)
    clips.py     a video: a file's header checked before decoding, then read and sampled (`check_clip`)
    requests.py  what comes with them: the question, the answer length, the budget as typed (`read_budget`),
                 and a whole request's visuals and questions at once (`check_items`)

A method and the encoding are checked beside the method registry they need, in `arr_coc.pipeline.request`
(`check_method`, `check_encode`, `check_for_video`, and `validate`, a whole request in one fixed order): the
pipeline runs this validator, so the validator cannot import the pipeline. Every refusal is an
`arr_coc.errors.InputError`.

`ARRCOC.generate`, `python -m arr_coc ask` and the microscope app all check their inputs here, so the
same input gets the same verdict and the same words everywhere. A problem is an `InputError` whose
message says what is wrong and what to do, and never names a server's file paths; `InputError.code`
names the case for programs and tests. What can be made valid safely is made valid, with a note:

| input | verdict |
|---|---|
| animated image | the first frame, with a note |
| 16-bit / 32-bit, CMYK, palette, transparency | 8-bit RGB (alpha flattened onto white), with a note |
| EXIF orientation | applied once (`upright`); the picture keeps no orientation tag, so checking it again changes nothing |
| more than `max_image_pixels` | downscaled keeping its aspect ratio inside the model's limit, with a note |
| aspect ratio beyond `max_aspect` (200:1, what Qwen-VL takes) up to `max_pad_aspect` | padded with white to 200:1, with a note |
| fewer than `min_image_pixels` (1 x 1, 20 x 20), thinner than `max_pad_aspect`, more than `max_decode_pixels` (checked before decoding; decompression bombs), a file over `max_file_bytes`, empty, truncated, not an image, a folder, a device or a pipe, missing | refused |
| a video (`check_clip`: a path, frames, an array or an `arr_coc.video.Clip`): a path with a video extension where an image could be (`generate("clip.mp4", q)`; not .gif, which stays an animated image) | read as a video, sampled as the model's processor samples (`arr_coc.video.load_clip`) |
| a video: one frame (`min_frames`), more frames kept than `max_frames` (asked for, or given whole), sampled frames over `max_clip_pixels` together (checked before decoding), frames under `min_image_pixels`, over `max_decode_pixels` or thinner than `max_aspect` (a video is not padded), a file over `max_video_file_bytes`, empty, truncated (fewer frames than its header declares, a decoder error, or a WebM/MKV ending well before its stated duration), damaged, not a video, no video stream, frames of different sizes, frames that are not RGB, missing | refused |
| a question: empty or blank, over `max_question_chars`, not text (a list, a dict, a number) | refused |
| a question with NUL or other control characters | those removed, with a note |
| a budget: not a share in (0, 1] or a count in [1, `max_budget_count`] (`arr_coc.budget` reads it) | refused |
| an unknown method | refused, naming the known ones |
| an answer length (`max_new_tokens`) below 1 or not a whole number | refused |
| encode settings that contradict each other, or encode before for a method that reads encoded tokens | refused |

Special-token strings in a question (`<|im_end|>`, `<|image_pad|>`, ...) are not an input problem: the
question is tokenized as plain text (`arr_coc.qwen.processing.encode_prompts`), so they are characters.
The limits are `LIMITS` (an `InputLimits`); `limits_for(processor)` raises the downscale cap to a model's
own input size when that is larger. Nothing is imported here, and nothing heavy until an image is read.
"""
