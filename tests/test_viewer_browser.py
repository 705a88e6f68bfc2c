"""The viewer in headless Chromium (Playwright driving the system's chromium): every defect of issue 29
fixed and every feature of the page exercised by a click, a hover or a look at what Plotly drew.

Runs are written by hand (no model): "long" has 30 traced steps of 4 episodes (paging, sorting, a
200 kB tool output, an episode the trainer did not score, a NaN reward, a long finish reason),
"short" has steps 1-3. Skipped without playwright (`pip install playwright`) or chromium
(`apt-get install chromium`); one browser for the module, a page per test.
`AGENTRL_SCREENSHOT_DIR=docs` keeps the screenshots (docs/viewer_*.png).
"""
import csv
import io
import json
import os
import shutil
import threading

import pytest

from lib.viewer import FOLD_CHARS, MAX_EPISODES_SHOWN, NOT_SCORED, main, make_server

SCREENSHOT_DIR = os.environ.get("AGENTRL_SCREENSHOT_DIR", "")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = [pytest.mark.slow,  # ~45 s on 2 busy cores: one chromium, 14 page loads
              pytest.mark.skipif(sync_playwright is None, reason="no playwright (pip install playwright)"),
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")]

LONG_FINISH = "a_finish_reason_that_goes_on_" * 8
EVIL_METRIC = '<img src=x onerror="document.title=\'pwned\'">'
STEPS = 30


def episode(step, index, text, reward=1.0, turns=None, tlp=True, **fields) -> dict:
    words = text.split(" ")
    toks = [w + " " for w in words]
    n = len(toks)
    lp = [-0.1 * (i % 5) for i in range(n)]
    return {"step": step, "group": 0, "index": index, "question": f"question {step % 3}", "gold": "42",
            "answer": "42", "reward": reward, "advantage": reward - 0.5, "finish": "answer", "correct": None,
            "tool_failures": 0, "stats": {}, "prompt": "Question: ...\n",
            "turns": turns or [{"role": "model", "start": 0, "end": n, "text": text}],
            "tokens": {"id": list(range(n)), "text": toks, "mask": [1] * n, "lp": lp,
                       "tlp": [v - 0.01 for v in lp] if tlp else None, "ver": [step - 1] * n}, **fields}


def long_run_records() -> list[dict]:
    records = []
    for step in range(1, STEPS + 1):
        for index in range(4):
            fields = {}
            text = f"step {step} episode {index} thinks and answers 42"
            if (step, index) == (5, 3):
                text += " needle"
            if (step, index) == (STEPS, 3):
                text = f"step {step} episode 2 thinks then answers 41"  # one token off episode 2
            if (step, index) == (STEPS, 0):
                fields["turns"] = [{"role": "model", "start": 0, "end": 3, "text": "<search> x </search>"},
                                   {"role": "tool", "start": 3, "end": 4, "text": "tool output " * 16_667}]
            if (step, index) == (STEPS - 2, 0):
                fields["finish"] = LONG_FINISH
            reward = float("nan") if (step, index) == (STEPS - 1, 2) else (index % 2) * step / STEPS
            records.append(episode(step, index, text, reward=reward, tlp=(step, index) != (STEPS, 1), **fields))
    return records


def write_run(run_dir, records, metric_rows, config=None) -> str:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "traces.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in metric_rows))
    if config is not None:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f)
    return str(run_dir)


def metric_row(step: int, scale: float) -> dict:
    return {"step": step, "time/wall_s": 60.0 * step * scale, "rollout/reward": scale * step / STEPS,
            "reward/timeouts": 0.0,  # its group "reward/*" is not the panel "reward"
            "logprob/server_trainer_abs_diff_mean": 1e-4 * 1.3 ** step,  # spans two decades: log y
            "logprob/behaviour_weight_mean": 1.000002 + step * 1e-6,  # long tick labels
            "tool/calls": 2.0 + step % 3, "tool/failures": float(step % 2), EVIL_METRIC: 1.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser_runs")
    long_run = write_run(root / "long", long_run_records(), [metric_row(s, 1.0) for s in range(1, STEPS + 1)],
                         {"lr": 1e-4, "group_size": 4, "task": {"name": "calc"}})
    short_run = write_run(root / "short", [episode(s, i, f"short {s} {i}") for s in (1, 2, 3) for i in range(2)],
                          [metric_row(s, 0.5) for s in (1, 2, 3)], {"lr": 3e-4, "group_size": 4})
    return [long_run, short_run]


@pytest.fixture(scope="module")
def base(runs):
    server = make_server(runs, port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def context(browser):
    context = browser.new_context(viewport={"width": 1300, "height": 800}, accept_downloads=True)
    yield context  # one HTTP cache for the module: plotly.min.js is compiled once
    context.close()


@pytest.fixture
def page(context):
    page = context.new_page()
    page.add_init_script("localStorage.clear()")  # the plot controls a test set do not reach the next test
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    page.close()
    assert not errors, errors


def open_page(page, url: str, plots: bool = True):
    """`plots` False: a test of the trajectories, the page loads without Plotly and series (faster)."""
    if not plots:
        page.route("**/plotly.min.js", lambda route: route.abort())
        page.route("**/api/series*", lambda route: route.abort())
    page.goto(url)
    if plots:  # the series fetched and the panels in view drawn
        page.wait_for_function("document.querySelectorAll('.plot .main-svg').length >= 8", timeout=20_000)


def shot(page, name: str, tmp_path, full_page: bool = False, clip_to: str | None = None, scroll_to: str | None = None):
    path = os.path.join(SCREENSHOT_DIR or str(tmp_path), name)
    if scroll_to:
        page.locator(scroll_to).first.evaluate("e => e.scrollIntoView()")
    if clip_to:
        page.locator(clip_to).first.screenshot(path=path)
    else:
        page.screenshot(path=path, full_page=full_page)
    assert os.path.getsize(path) > 3_000, "a blank screenshot"


def plot(page, title: str) -> dict:
    """What Plotly holds for the panel `title`: its traces (name, x, y, opacity) and layout."""
    return page.evaluate("""title => {
        const div = [...document.querySelectorAll('.plot')].find(d => d.dataset.title === title);
        div.scrollIntoView();
        draw(title);
        return {data: div.data.map(t => ({name: t.name, x: t.x, y: t.y, opacity: t.opacity ?? 1,
                                          hover: t.hovertemplate || ''})),
                layout: {ytype: div._fullLayout.yaxis.type, hovermode: div._fullLayout.hovermode,
                         xrange: div._fullLayout.xaxis.range, xtitle: div._fullLayout.xaxis.title.text}};
    }""", title)


# --- defects (D8 with the plot features it serves) ---
def test_d1_switching_run_shows_the_new_runs_latest_step_and_a_step_it_lacks_is_named(page, base):
    open_page(page, base + "?run=0&step=30", plots=False)
    page.select_option("#run-select", "1")  # the form used to carry step 30 to a run of steps 1-3
    page.wait_for_url("**run=1**")
    assert "step=30" not in page.url and page.input_value("#step-select") == "3"
    assert page.locator(".episode").count() == 2 and "0 episodes" not in page.inner_text("#count")
    open_page(page, base + "?run=1&step=4", plots=False)
    assert "step 4 is not traced in short (traced: 1–3, 3 steps); showing step 3" in page.inner_text("#notice")
    assert page.input_value("#step-select") == "3" and page.locator('.group[data-step="3"] .episode').count() == 2


def test_d4_gap_colouring_paints_tokens_the_trainer_did_not_score_yellow_not_white(page, base, tmp_path):
    open_page(page, base + f"?run=0&step={STEPS}&episode=1&colour=gap", plots=False)
    backgrounds = page.eval_on_selector_all(".episode .tok", "ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    r, g, b = (int(NOT_SCORED[i:i + 2], 16) for i in (1, 3, 5))
    assert backgrounds and set(backgrounds) == {f"rgb({r}, {g}, {b})"}
    assert "not scored by the trainer" in page.inner_text("p.legend") and "not scored" in page.inner_text(".episode-head")
    open_page(page, base + f"?run=0&step={STEPS}&episode=2&colour=gap", plots=False)  # scored: 0.01 apart, near white
    assert "rgb(255, 240, 179)" not in page.eval_on_selector_all(
        ".episode .tok", "ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    page.locator(".episode").first.evaluate("e => e.querySelector('details.token-view').open = true")
    shot(page, "viewer_gap_unscored.png", tmp_path, clip_to="p.legend")


def test_d5_an_episode_with_a_nan_reward_is_not_shown_under_a_reward_filter(page, base):
    open_page(page, base + f"?run=0&step={STEPS - 1}", plots=False)
    assert page.locator('.episode[data-reward="nan"]').count() == 1  # shown without a filter, reward "?"
    open_page(page, base + f"?run=0&step={STEPS - 1}&min_reward=-1000", plots=False)
    assert page.locator('.episode[data-reward="nan"]').count() == 0 and page.locator(".episode").count() == 3
    open_page(page, base + f"?run=0&step={STEPS - 1}&max_reward=1000", plots=False)
    assert page.locator('.episode[data-reward="nan"]').count() == 0


def test_d6_tick_labels_of_1_000002_fit_their_panel_and_a_long_finish_reason_fits_the_window(page, base, tmp_path):
    open_page(page, base)
    plot(page, "behaviour weight")
    lefts = page.evaluate("""() => {
        const div = [...document.querySelectorAll('.plot')].find(d => d.dataset.title === 'behaviour weight');
        const box = div.getBoundingClientRect();
        return [...div.querySelectorAll('.ytick text')].map(t => [t.getBoundingClientRect().left - box.left, t.textContent]);
    }""")
    assert lefts and all(left >= 0 for left, _ in lefts), lefts
    assert any(len(text) >= 7 for _, text in lefts)  # labels as long as 1.00001 are there, whole
    page.set_viewport_size({"width": 700, "height": 900})
    form = page.evaluate("""() => { const f = document.getElementById('filters');
        return [f.scrollWidth, f.clientWidth, f.getBoundingClientRect().right, window.innerWidth]; }""")
    assert LONG_FINISH in page.inner_html("#filters")  # the option is there, its select kept narrow
    assert form[0] <= form[1] and form[2] <= form[3], form
    shot(page, "viewer_narrow_form.png", tmp_path, clip_to="#filters")


def test_d7_a_200_kb_tool_output_is_folded_after_its_first_characters(page, base):
    open_page(page, base + f"?run=0&step={STEPS}&episode=0", plots=False)
    tool = page.locator(".turn.tool").first
    assert len(tool.inner_text()) < FOLD_CHARS + 200  # the rest is in a closed <details>
    height_folded = tool.bounding_box()["height"]
    assert "more characters" in tool.inner_text() and height_folded < 1000
    tool.locator("summary").click()
    assert len(tool.inner_text()) > 199_000 and tool.bounding_box()["height"] > height_folded


def test_d8_series_come_as_json_plotly_from_the_viewer_unknown_metrics_by_prefix_and_a_run_can_be_hidden(page, base, tmp_path):
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    open_page(page, base + "?step=12")
    html_bytes = len(page.request.get(base + "?step=12").body())
    assert html_bytes < 100_000  # every series of both runs used to be in it
    paths = [u[len(base) - 1:] for u in requests]
    assert "/plotly.min.js" in paths and "/api/series?run=0&since=0&generation=" in paths
    assert all(u.startswith(base) or u.startswith("data:") for u in requests), requests  # offline: no CDN
    status = page.inner_text("#series-status")
    assert f"({STEPS} + 3 rows)" in status
    # a metric the viewer does not know is plotted in its prefix group, its name as text
    tool = plot(page, "tool/*")
    assert sorted({t["name"] for t in tool["data"]}) == ["tool/calls", "tool/failures"]
    assert {t["name"] for t in plot(page, "reward")["data"]} == {"rollout/reward"}
    assert {t["name"] for t in plot(page, "reward/*")["data"]} == {"reward/timeouts"}
    titles = page.eval_on_selector_all("#extra-plots .plot", "ds => ds.map(d => d.dataset.title)")
    assert "tool/*" in titles and EVIL_METRIC in titles
    evil = plot(page, EVIL_METRIC)
    page.wait_for_timeout(200)
    assert page.title().startswith("agentrl viewer") and "pwned" not in page.title()
    assert page.evaluate("""name => [...document.querySelectorAll('.plot')].find(d => d.dataset.title === name)
                               .querySelector('.gtitle').textContent""", EVIL_METRIC) == EVIL_METRIC
    assert page.locator("#extra-plots img").count() == 0
    assert evil["data"][0]["name"].startswith("&lt;img")
    plot(page, "tool/*")
    shot(page, "viewer_other_metrics.png", tmp_path, clip_to="#extra-plots")
    # hiding a run removes it from every panel
    assert len(plot(page, "tool/*")["data"]) == 4
    page.locator('.run-toggle[data-run="1"]').uncheck()
    for title in ("reward", "tool/*", "server-trainer |Δ log-prob|"):
        assert all("long · " in t["hover"] for t in plot(page, title)["data"]), title
    page.locator('.run-toggle[data-run="1"]').check()
    assert len(plot(page, "tool/*")["data"]) == 4


def test_smoothing_log_y_wall_time_unified_hover_toolbar_and_csv_of_the_shown_series(page, base, tmp_path):
    open_page(page, base)
    reward = plot(page, "reward")
    assert [t["opacity"] for t in reward["data"]] == [1, 1]  # one trace a run
    assert plot(page, "server-trainer |Δ log-prob|")["layout"]["ytype"] == "log"  # values over two decades
    assert plot(page, "reward")["layout"]["ytype"] == "linear"
    page.locator("#smoothing").fill("0.9")
    smoothed = plot(page, "reward")
    raw, smooth = smoothed["data"][0], smoothed["data"][1]
    assert raw["opacity"] == 0.25 and smooth["opacity"] == 1 and raw["y"] == reward["data"][0]["y"]
    assert smooth["y"][0] == pytest.approx(raw["y"][0])  # debiased: the first point is not pulled to 0
    assert smooth["y"][-1] < raw["y"][-1]  # a rising series: the average lags
    page.select_option("#xaxis", "wall")
    wall = plot(page, "reward")
    assert wall["data"][1]["x"][:3] == [1.0, 2.0, 3.0] and wall["layout"]["xtitle"] == "wall time (min)"
    short_x = [t for t in wall["data"] if "short" in t["hover"]][-1]["x"]
    assert short_x == [0.5, 1.0, 1.5]  # the short run's own clock
    page.select_option("#xaxis", "step")
    page.locator("#smoothing").fill("0.6")  # the screenshot shows it
    info = plot(page, "reward")
    assert info["layout"]["hovermode"] == "x unified"
    box = page.locator('.plot[data-title="reward"] .nsewdrag').first.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.05, box["y"] + box["height"] / 2)
    page.wait_for_selector('.plot[data-title="reward"] .hoverlayer .legend', timeout=5000)
    hover = page.locator('.plot[data-title="reward"] .hoverlayer').text_content()
    assert "long · rollout/reward" in hover and "short · rollout/reward" in hover  # both runs at one step
    shot(page, "viewer_plots.png", tmp_path)
    page.locator("#smoothing").fill("0")
    # a long series is drawn thinned, its peak kept, every point of a zoomed range drawn
    thinned = page.evaluate("""() => {
        const x = [...Array(5000).keys()], y = x.map(i => i === 1234 ? 99 : Math.sin(i));
        const whole = decimate({x, y, raw: y}, null), zoomed = decimate({x, y, raw: y}, [2000, 2999]);
        return [whole.x.length, whole.y.includes(99), zoomed.x.filter(v => v >= 2000 && v <= 2999).length];
    }""")
    assert thinned[0] <= 600 and thinned[1] and thinned[2] == 1000
    # the Plotly toolbar downloads a PNG; CSV exports the shown series
    plot(page, "reward")
    reward = page.locator('.plot[data-title="reward"]')
    reward.hover()
    assert reward.locator('.modebar-btn[data-title="Download plot as a PNG"]').count() == 1
    assert reward.locator('.modebar-btn[data-title="Reset axes"]').count() == 1
    with page.expect_download() as png:
        reward.locator('.modebar-btn[data-title="Download plot as a PNG"]').click()
    assert png.value.suggested_filename == "reward.png"
    page.locator('.run-toggle[data-run="1"]').uncheck()  # only the shown series
    with page.expect_download() as download:
        page.click("#csv")
    path = tmp_path / "series.csv"
    download.value.save_as(path)
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert {r["run"] for r in rows} == {"long"}
    reward_rows = [r for r in rows if r["metric"] == "rollout/reward"]
    assert [int(r["step"]) for r in reward_rows] == list(range(1, STEPS + 1))
    assert float(reward_rows[-1]["value"]) == pytest.approx(1.0)
    assert any(r["metric"] == EVIL_METRIC for r in rows)  # CSV quoting kept the name whole


def test_the_config_table_shows_each_run_and_puts_the_fields_that_differ_first(page, base, tmp_path):
    open_page(page, base, plots=False)
    rows = page.eval_on_selector_all("table.config tr", "rs => rs.map(r => [r.className, r.innerText])")
    assert rows[1][0] == "differs" and rows[1][1].split("\t")[:3] == ["lr", "0.0001", "0.0003"]
    assert any(text.startswith("task.name\tcalc") for _, text in rows)
    shot(page, "viewer_config.png", tmp_path, clip_to="#config")


def test_auto_refresh_draws_new_steps_and_keeps_zoom_and_scroll(page, base, runs):
    open_page(page, base)
    page.select_option("#refresh", "2")
    plot(page, "reward")
    page.evaluate("""() => { const div = [...document.querySelectorAll('.plot')].find(d => d.dataset.title === 'reward');
                             return Plotly.relayout(div, {'xaxis.range': [5, 12]}); }""")
    scroll_y = page.evaluate("window.scrollY")
    with open(os.path.join(runs[0], "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metric_row(STEPS + 1, 1.0)) + "\n")
    try:
        page.wait_for_function(f"document.getElementById('series-status').textContent.includes('({STEPS + 1} + 3 rows)')",
                               timeout=10_000)
        after = page.evaluate("""() => { const div = [...document.querySelectorAll('.plot')].find(d => d.dataset.title === 'reward');
                                         return [div.data[0].x.at(-1), div._fullLayout.xaxis.range, window.scrollY]; }""")
        assert after[0] == STEPS + 1 and after[1] == [5, 12] and after[2] == scroll_y
    finally:
        page.select_option("#refresh", "0")  # localStorage: off for the pages after this one
        with open(os.path.join(runs[0], "metrics.jsonl"), "r+") as f:
            lines = f.readlines()
            f.seek(0)
            f.writelines(lines[:-1])
            f.truncate()


# --- trajectories ---
def test_search_sort_and_pages_newest_first_with_a_count(page, base, tmp_path):
    open_page(page, base + "?run=0&step=all", plots=False)
    count = page.inner_text("#count")
    assert f"{STEPS * 4} episodes match, 1–{MAX_EPISODES_SHOWN} shown (page 1 of 2)" in count
    steps = page.eval_on_selector_all(".group", "gs => gs.map(g => Number(g.dataset.step))")
    assert steps[0] == STEPS and steps == sorted(steps, reverse=True)  # newest first
    page.click("#later-page")
    page.wait_for_url("**page=1**")
    assert f"{MAX_EPISODES_SHOWN + 1}–{STEPS * 4} shown (page 2 of 2)" in page.inner_text("#count")
    assert page.eval_on_selector_all(".group", "gs => gs.map(g => Number(g.dataset.step))")[-1] == 1
    open_page(page, base + "?run=0&step=all", plots=False)
    page.fill('input[name="q"]', "NEEDLE")
    page.select_option('select[name="sort"]', "reward_desc")
    page.click('#filters button[type="submit"]')
    page.wait_for_url("**q=NEEDLE**")
    assert page.inner_text("#count").startswith("1 episode match") and "needle" in page.inner_text(".episode")
    open_page(page, base + "?run=0&step=all&sort=reward_desc", plots=False)
    rewards = [float(r) for r in page.eval_on_selector_all(".episode", "es => es.map(e => e.dataset.reward)")]
    assert rewards == sorted(rewards, reverse=True) and rewards[0] == 1.0
    open_page(page, base + "?run=0&step=all&sort=length_desc", plots=False)
    assert "needle" in page.locator(".episode").first.inner_text()  # one token more than every other episode
    gen = [int(t.split()[0]) for t in page.eval_on_selector_all(".episode-head .muted", "ms => ms.map(m => m.textContent)")
           if "generated tokens" in t]
    assert gen == sorted(gen, reverse=True)
    shot(page, "viewer_trajectories.png", tmp_path, scroll_to="#filters")


def test_a_permalink_shows_one_episode_and_prev_next_walk_the_traced_steps(page, base):
    open_page(page, base + "?run=0&step=12", plots=False)
    page.locator(".episode").nth(2).locator("a.permalink").click()
    page.wait_for_url("**episode=2**")
    assert page.locator(".episode").count() == 1 and page.url.endswith("#ep-0-12-0-2")
    assert page.evaluate("document.querySelector('.episode:target') !== null")
    open_page(page, base + "?run=0&step=12", plots=False)
    page.click("#prev-step")
    page.wait_for_url("**step=11**")
    assert page.input_value("#step-select") == "11"
    page.click("#next-step")
    page.click("#next-step")
    page.wait_for_url("**step=13**")
    assert page.input_value("#step-select") == "13" and page.locator('.group[data-step="13"]').count() == 1


def test_the_same_question_across_steps_and_across_runs_side_by_side(page, base, tmp_path):
    open_page(page, base + "?run=0&step=3", plots=False)
    page.click(".group a.same-steps")
    page.wait_for_url("**question=**")
    steps = page.eval_on_selector_all(".group", "gs => gs.map(g => Number(g.dataset.step))")
    assert steps == [s for s in range(STEPS, 0, -1) if s % 3 == 0]  # "question 0": every third step
    open_page(page, base + "?run=0&step=3", plots=False)
    page.click(".group a.same-runs")
    page.wait_for_url("**compare=1**")
    groups = page.eval_on_selector_all(".group", "gs => gs.map(g => [g.dataset.run, g.dataset.step, "
                                                 "Math.round(g.getBoundingClientRect().left)])")
    assert {(run, step) for run, step, _ in groups if run == "1"} == {("1", "3")}
    lefts = {run: {left for r, _, left in groups if r == run} for run in ("0", "1")}
    assert len(lefts["0"]) == len(lefts["1"]) == 1 and lefts["0"] != lefts["1"]  # a run a column
    shot(page, "viewer_compare.png", tmp_path, scroll_to="#filters")


def test_a_token_level_diff_of_two_ticked_episodes(page, base, tmp_path):
    open_page(page, base + f"?run=0&step={STEPS}", plots=False)
    page.locator(".diff-pick").nth(2).check()
    page.locator(".diff-pick").nth(3).check()
    page.wait_for_selector("#diff .toks")
    deleted = page.eval_on_selector_all("#diff .tok.del", "ts => ts.map(t => t.textContent)")
    inserted = page.eval_on_selector_all("#diff .tok.ins", "ts => ts.map(t => t.textContent)")
    assert deleted[1:] == ["and ", "42 "] and inserted[1:] == ["then ", "41 "]  # [0]: the header's labels
    assert "6 tokens in common" in page.inner_text("#diff b")
    shot(page, "viewer_diff.png", tmp_path, clip_to="#diff")
    page.locator(".diff-pick").nth(3).uncheck()
    assert page.locator("#diff").is_hidden()


def test_out_writes_a_range_of_steps_that_draws_offline(page, runs, tmp_path):
    out = tmp_path / "page.html"
    main([runs[0], "--out", str(out), "--steps", "10-12"])
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    open_page(page, out.as_uri())
    assert sorted({int(s) for s in page.eval_on_selector_all(".group", "gs => gs.map(g => g.dataset.step)")}) == [10, 11, 12]
    assert page.locator(".episode").count() == 12 and requests == [out.as_uri()]  # Plotly and series inline
    assert len(plot(page, "reward")["data"][0]["x"]) == STEPS
    with pytest.raises(SystemExit):
        main([runs[0], "--out", str(out), "--steps", "ten"])
