"""The stages diagram (`tpupedia.diagrams.stages`) is driven by the pipeline's stage list and by
the stage files a run wrote, as the stage-file reader checked them."""

import matplotlib

matplotlib.use("Agg")

from tpupedia.diagrams import stages as diagram
from tpupedia.pipelines import stages

ORDER = ("text", "image", "denoise", "decode")
INPUTS = {"text": (), "image": (), "denoise": ("text", "image"), "decode": ("denoise",)}


def record(**tensors):
    return {"tensors": {k: {"shape": list(s), "dtype": "bfloat16"} for k, s in tensors.items()},
            "fingerprint": "0123456789abcdef", "sha256": "f" * 64}


RECORDS = {"text": record(prompt_embeds=(2, 226, 4096)), "denoise": record(latents=(1, 22, 16, 96, 170)),
           "decode": record(frames=(85, 768, 1360, 3))}


def test_columns_follow_the_inputs_and_absent_stages_are_marked():
    plan = diagram.layout(ORDER, INPUTS, RECORDS)
    cards = {c.stage: c for c in plan.cards}
    assert cards["text"].x == cards["image"].x < cards["denoise"].x < cards["decode"].x
    assert cards["image"].stage_y > cards["text"].stage_y  # the same depth: stacked, text lowest
    assert [c.ran for c in plan.cards] == [True, False, True, True]
    assert {(link.source, link.target): link.ran for link in plan.links} == {
        ("text", "denoise"): True, ("image", "denoise"): False, ("denoise", "decode"): True}


def test_cards_list_the_files_tensors_as_recorded():
    cards = {c.stage: c for c in diagram.layout(ORDER, INPUTS, RECORDS).cards}
    assert cards["text"].lines[:4] == ("text.safetensors", "+ text.json (its record)", "prompt_embeds",
                                       "    (2, 226, 4096) bfloat16")
    other = dict(RECORDS, text=record(prompt_embeds=(1, 16, 32)))
    assert "    (1, 16, 32) bfloat16" in {c.stage: c for c in diagram.layout(ORDER, INPUTS, other).cards}["text"].lines


def test_records_are_the_readers_checks(tmp_path):
    import torch

    settings = {"text": {"prompt": "a panda"}, "denoise": {"prompt": "a panda", "seed": 42}}
    stages.write(tmp_path, "text", {"prompt_embeds": torch.zeros(1, 4, 8, dtype=torch.bfloat16)}, settings["text"])
    stages.write(tmp_path, "denoise", {"latents": torch.ones(1, 2, 3)}, settings["denoise"])
    found = diagram.records(tmp_path, settings)
    assert found["text"]["tensors"] == {"prompt_embeds": {"shape": [1, 4, 8], "dtype": "bfloat16"}}
    assert found["denoise"]["fingerprint"] == stages.fingerprint(settings["denoise"])
    stale = diagram.records(tmp_path, {"denoise": {"prompt": "a panda", "seed": 7}})["denoise"]
    assert isinstance(stale, str) and "seed=42 in the file, seed=7 in this run" in stale


def test_draw_reads_the_run(tmp_path):
    import torch

    class Pipe:  # what draw asks of a pipeline: its settings per stage, whether it has an image stage
        image_to_video = False

        def settings(self, stage, request):
            return {"stage": stage, "prompt": request.prompt}

    class Request:
        prompt, image = "a panda", None

    for stage, name in (("text", "prompt_embeds"), ("denoise", "latents"), ("decode", "frames")):
        stages.write(tmp_path, stage, {name: torch.zeros(3, 5)}, Pipe().settings(stage, Request))
    texts = [t.get_text() for t in diagram.draw(Pipe(), Request, tmp_path).axes[0].texts]
    assert texts.count("    (3, 5) float32") == 3 and "latents" in texts
    assert not any("image" in t for t in texts)  # the pipeline has no image stage
