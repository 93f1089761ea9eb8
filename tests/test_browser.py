"""The microscope in a real browser: Debian chromium driven by playwright, on the embedded model.

A missing browser FAILS this test (it never skips): `make test` installs Debian's chromium when
/usr/bin/chromium is absent. Set ARR_COC_SCREENSHOT=1 to write the screenshot to
docs/app_screenshot.png (otherwise it goes to pytest's tmp folder).
"""

from __future__ import annotations

import os
import warnings

import pytest

from _app_server import ROOT, AppProcess

from arr_coc_microscope.page import read_examples  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 120_000  # the host is shared with a training run
# JS: the cells of the stats table row whose first cell is `name` (or null)
STATS_ROW = ("(name => [...document.querySelectorAll('#stats [role=row]')]"
             ".map(r => [...r.querySelectorAll('[role=gridcell]')].map(c => c.innerText.trim()))"
             ".find(cells => cells[0] === name) || null)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = AppProcess(tmp_path_factory.mktemp("browser_app"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def page(server):
    assert os.path.exists(CHROMIUM), (
        f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium; `make test` does it). "
        "Never `playwright install`.")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        pg = browser.new_page(viewport={"width": 1440, "height": 1000})
        pg.set_default_timeout(TIMEOUT_MS)
        pg.goto(server.url)
        pg.wait_for_selector("#run")
        yield pg
        browser.close()


def _value(page, elem_id: str) -> str:
    return page.eval_on_selector(f"#{elem_id} textarea", "el => el.value")


def _wait_value(page, elem_id: str, predicate_js: str) -> None:
    page.wait_for_function(
        f"() => {{ const v = document.querySelector('#{elem_id} textarea').value; return {predicate_js}; }}",
        timeout=TIMEOUT_MS)


def _wait_images(page, elem_id: str, n: int) -> None:
    """At least n images inside #elem_id have loaded (scrolled into view first: they may be lazy)."""
    page.locator(f"#{elem_id}").scroll_into_view_if_needed()
    page.wait_for_function(f"() => [...document.querySelectorAll('#{elem_id} img')]"
                           f".filter(i => i.complete && i.naturalWidth > 0).length >= {n}", timeout=TIMEOUT_MS)


def _wait_layers(page, main: str) -> None:
    """Both configs' layer dropdowns show `main`.

    In three fresh-clone suites (two on 2026-11-25 at this wait, one earlier at the run after it; never
    alone, never in the working tree's suites) they had not, 120 s after "encode before" then "gist
    0.25". The cause is not found: running the swaps in trigger order did not cure it. So after 30 s this warns with what the dropdowns show,
    which lands in the suite's summary, and changes the gist once more (0.2, then 0.25 again): the
    swaps must then land, or the test fails.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    settled = "main => ['layer', 'compare-layer'].every(id => document.querySelector(`#${id} input`).value === main)"
    try:
        page.wait_for_function(settled, arg=main, timeout=30_000)
        return
    except PlaywrightTimeout:
        shown = page.evaluate("() => ['layer', 'compare-layer', 'gist'].map(id => document.querySelector(`#${id} input`).value)")
        warnings.warn(f"layer swaps had not landed 30 s after encode=before + gist 0.25: layer, compare-layer, gist = "
                      f"{shown}, expected {main!r} for both layers; changing the gist again")
    for share in ("0.2", "0.25"):
        page.fill("#gist input[type=number]", share)
        page.press("#gist input[type=number]", "Enter")
    page.wait_for_function(settled, arg=main, timeout=TIMEOUT_MS)


def test_ask_toggle_pictures_screenshot_and_examples(page, tmp_path):
    """One session on the page, step by step: the baseline alone, both configs, config A before the tower with
    its settings, the pictures and the screenshot, an example row and a bad input, the slider at its maximum."""
    examples = read_examples()
    first = next(e for e in examples if os.path.basename(e["image"]) == "shapes_letter.png")
    _baseline_alone(page, first)
    _both_configs(page)
    _config_a_before(page)
    _pictures_and_screenshot(page, tmp_path)
    _example_row_and_a_bad_input(page, examples)
    _slider_at_its_maximum(page)


def _baseline_alone(page, first) -> None:
    """Upload + question; ARR-COC off: the baseline alone answers."""
    page.set_input_files("#image input[type=file]", first["image"])
    page.wait_for_selector("#image img")
    page.fill("#question textarea", first["question"])
    toggle = page.locator("#arr-toggle input[type=checkbox]")
    assert toggle.is_checked()
    toggle.click()
    assert not toggle.is_checked()
    page.click("#run")
    _wait_value(page, "answer-arr", "v.includes('ARR-COC is off')")
    _wait_value(page, "answer-baseline", "v.length > 0")


def _both_configs(page) -> None:
    """ARR-COC on again, the page's defaults: config A encodes after, config B (the same layer) before."""
    toggle = page.locator("#arr-toggle input[type=checkbox]")
    toggle.click()
    assert toggle.is_checked()
    page.click("#run")
    _wait_value(page, "answer-compare", "v.length > 0 && !v.includes('ARR-COC is off')")
    assert _value(page, "answer-baseline") and _value(page, "answer-arr")
    encoded = page.evaluate(f"() => {STATS_ROW}('cells encoded at full resolution')")
    assert encoded[2] == "256 (100%)" and int(encoded[3].split()[0]) < 256, encoded
    stats = page.inner_text("#stats")
    assert "whole prefill speedup" in stats and "vision GFLOPs" in stats
    assert "Error" not in page.inner_text("#error")


def _config_a_before(page) -> None:
    """The toggle: config A encodes before, with the before mode's settings; its encoded cells shrink."""
    main_layer = page.eval_on_selector("#layer input", "el => el.value")
    page.locator("#encode input[type=radio][value=before]").check()   # check() fails unless it took
    page.locator("#before-settings").get_by_text("encode before: gist, margin, periphery").click()
    page.fill("#gist input[type=number]", "0.25")
    page.press("#gist input[type=number]", "Enter")
    page.fill("#margin input[type=number]", "1")
    page.press("#margin input[type=number]", "Enter")
    page.locator("#periphery input[type=checkbox]").check()
    # with a gist both configs show the --arr-coc layer again (layer_for_mode); let those swaps land before the run
    _wait_layers(page, main_layer)
    page.click("#run")
    page.wait_for_function(f"() => {{ const r = {STATS_ROW}('encode'); return r && r[2].startsWith('before'); }}")
    row = page.evaluate(f"() => {STATS_ROW}('encode')")
    assert row == ["encode", "after", "before (gist 0.25, margin 1, periphery)",
                   "before (gist 0.25, margin 1, periphery)"], row
    encoded = page.evaluate(f"() => {STATS_ROW}('cells encoded at full resolution')")
    periphery = page.evaluate(f"() => {STATS_ROW}('periphery tokens (gist, read)')")
    assert int(encoded[2].split()[0]) < 256 and int(periphery[2]) > 0, (encoded, periphery)


def _pictures_and_screenshot(page, tmp_path) -> None:
    """Config A back to after; B keeps before with the gist, margin and periphery: the screenshot shows both."""
    page.locator("#encode input[type=radio][value=after]").check()
    page.click("#run")
    page.wait_for_function(f"() => {{ const r = {STATS_ROW}('encode'); return r && r[2] === 'after'; }}")
    _wait_value(page, "answer-arr", "v.length > 0")
    for elem_id in ("heatmap", "resolution-a", "resolution-b"):
        _wait_images(page, elem_id, 1)
    _wait_images(page, "maps", 4)
    _wait_images(page, "channels", 14)  # gallery images load lazily: each check scrolls its gallery into view
    channel_names = page.inner_text("#channels")
    for name in ("sobel_mag", "sal_spectral", "cluster_rarity"):
        assert name in channel_names
    page.evaluate("window.scrollTo(0, 0)")
    out = ROOT / "docs" / "app_screenshot.png" if os.environ.get("ARR_COC_SCREENSHOT") == "1" else tmp_path / "app.png"
    page.screenshot(path=str(out), full_page=True)
    assert out.stat().st_size > 20_000


def _example_row_and_a_bad_input(page, examples) -> None:
    """An example row fills the inputs; a bad input gets its message in the page, and the next request works."""
    target = next(e for e in examples if os.path.basename(e["image"]) == "shapes_void.png")
    index = examples.index(target)
    page.locator("#examples tbody tr").nth(index).click()
    _wait_value(page, "question", f"v === {target['question']!r}")
    page.wait_for_selector("#image img")
    page.fill("#question textarea", "   ")
    page.click("#run")
    page.wait_for_function("() => document.querySelector('#error').innerText.includes('The question is empty')")
    page.fill("#question textarea", target["question"])
    page.click("#run")
    page.wait_for_function("() => !document.querySelector('#error').innerText.includes('Error')")
    _wait_value(page, "answer-arr", "v.length > 0")


def _slider_at_its_maximum(page) -> None:
    """JSON would send 1.0 as the integer 1, which the API refuses as ambiguous (as the command line refuses "1");
    the page sends it as "1.0" (page.slider_max_as_text): the share 1.0."""
    page.fill("#budget input[type=number]", "1")
    page.press("#budget input[type=number]", "Enter")
    page.click("#run")
    page.wait_for_function(f"() => {{ const r = {STATS_ROW}('budget'); return r && r[2] !== '0.25'; }}")
    assert page.evaluate(f"() => {STATS_ROW}('budget')") == ["budget", "1.0", "1.0", "1.0"]


def test_a_video_clip_in_the_browser(page, tmp_path):
    """A ShapesVQA-video clip uploaded in the video box is answered by the baseline and both configs; the strips
    show the temporal groups (ARR_COC_SCREENSHOT=1 writes docs/app_video_screenshot.png)."""
    from arr_coc_shapes.video import make_clip_item, save_clip

    frames, record, _ = make_clip_item(seed=0, split="test", index=2)     # "What color is the shape that moves?"
    clip = save_clip(frames, tmp_path / "clip.gif")
    page.locator("#video-box").get_by_text("video clip (replaces the image)").click()
    page.set_input_files("#video input[type=file]", str(clip))
    page.fill("#question textarea", record["question"])
    page.click("#run")
    page.wait_for_function("() => document.querySelector('#error').innerText.includes('A video:')", timeout=TIMEOUT_MS)
    row = page.evaluate(f"() => {STATS_ROW}('tokens per temporal group')")
    assert row is not None and len(row[1].split()) == record["n_frames"] // 2
    for elem_id in ("heatmap", "resolution-a"):
        _wait_images(page, elem_id, 1)
    page.evaluate("window.scrollTo(0, 0)")
    out = ROOT / "docs" / "app_video_screenshot.png" if os.environ.get("ARR_COC_SCREENSHOT") == "1" \
        else tmp_path / "app_video.png"
    page.screenshot(path=str(out), full_page=True)
    assert out.stat().st_size > 20_000
