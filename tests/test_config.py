"""Config: every shipped YAML validates; each bad case fails before any model loads, naming the key."""

from pathlib import Path

import pytest

from dflash.config import (
    ConfigError,
    RunConfig,
    default_gamma,
    load_config,
    parse_overrides,
    validate_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name,gpus", [("smollm2-135m-cpu", 0), ("qwen3.6-27b-8xgpu", 8), ("h200-2gpu", 2)])
def test_shipped_configs_validate(name, gpus):
    cfg = load_config(CONFIGS / f"{name}.yaml", gpu_count=gpus)
    assert cfg.name == name


def test_reference_layout_values():
    cfg = load_config(CONFIGS / "qwen3.6-27b-8xgpu.yaml", gpu_count=8)
    assert cfg.cluster.targets == [0, 1, 2, 3, 4]
    assert cfg.cluster.drafters == [5, 6, 7]
    assert cfg.data.token_budget == 49152
    assert cfg.drafter.block_size == 16
    assert cfg.drafter.num_layers == 5
    assert cfg.rows_per_batch == 16


def test_overrides_are_typed_and_nested():
    cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml",
                      ["drafter.block_size=4", "train.lr=1e-4", "cluster.drafters=[0, 1, 2]", "target.layer_ids=null"],
                      gpu_count=0)
    assert cfg.drafter.block_size == 4
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.cluster.drafters == [0, 1, 2]
    assert cfg.target.layer_ids is None


def test_int_widens_to_float_but_not_bool():
    cfg = load_config(None, ["train.lr=1", "cluster.device=cpu"], gpu_count=0)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    with pytest.raises(ConfigError, match=r"^train\.lr: expected a number"):
        load_config(None, ["train.lr=true", "cluster.device=cpu"], gpu_count=0)


BAD_CASES = [
    # (overrides, gpu_count, expected message prefix)
    (["drafter.blok_size=4"], 0, r"^drafter\.blok_size: unknown key"),
    (["trian.lr=1"], 0, r"^trian: unknown key"),
    (["drafter.block_size=eight"], 0, r"^drafter\.block_size: expected an integer"),
    (["drafter.block_size=2.5"], 0, r"^drafter\.block_size: expected an integer"),
    (["cluster.targets=0"], 0, r"^cluster\.targets: expected a list"),
    (["drafter.block_size=1"], 0, r"^drafter\.block_size: must be >= 2"),
    (["data.token_budget=100", "data.max_length=256"], 0, r"^data\.token_budget: \(100\) is smaller than one sequence"),
    (["cluster.device=cuda", "cluster.targets=[0]", "cluster.drafters=[0]"], 2, r"^cluster\.drafters: GPU\(s\) \[0\] are used by both"),
    (["cluster.device=cuda", "cluster.targets=[0]", "cluster.drafters=[5]"], 2, r"^cluster\.drafters: GPU 5 does not exist"),
    (["cluster.device=cuda", "cluster.targets=[9]", "cluster.drafters=[1]"], 2, r"^cluster\.targets: GPU 9 does not exist"),
    (["data.dataset=/no/such/file.jsonl"], 0, r"^data\.dataset: no such file"),
    (["target.kind=hf", "target.path=/no/such/dir"], 0, r"^target\.path: no such directory"),
    (["target.kind=random"], 0, r"^target\.arch: is required"),
    (["drafter.layer_types=[full_attention]", "drafter.num_layers=2"], 0, r"^drafter\.layer_types: has 1 entries"),
    (["drafter.layer_types=[full_attention, local]", "drafter.num_layers=2"], 0, r"^drafter\.layer_types\[1\]: must be"),
    (["data.max_length=4", "drafter.block_size=8"], 0, r"^data\.max_length: must be > drafter\.block_size"),
    (["cluster.device=gpu"], 0, r"^cluster\.device: must be one of"),
    (["transport.slots=0"], 0, r"^transport\.slots: must be >= 1"),
    (["train.warmup_ratio=1.5"], 0, r"^train\.warmup_ratio: must be in"),
    (["cluster.device=cpu", "transport.carrier=cuda_ipc"], 0, r"^transport\.carrier: cuda_ipc needs CUDA"),
    (["target.layer_ids=[3, 3]"], 0, r"^target\.layer_ids: has duplicates"),
    (["train.eval_batches=-1"], 0,
     r"^train\.eval_batches: must be >= 0 \(0 = no held-out evaluation, null = all held-out batches\), got -1$"),
    (["train.eval_every=-5"], 0, r"^train\.eval_every: must be >= 0, got -5$"),
    (["train.eval_head_tokens=0"], 0,
     r"^train\.eval_head_tokens: must be >= 1 \(response tokens counted by eval/tau_head\), got 0$"),
    (["train.eval_head_tokens=-96"], 0, r"^train\.eval_head_tokens: must be >= 1 .*, got -96$"),
    (["train.eval_head_tokens=2.5"], 0, r"^train\.eval_head_tokens: expected an integer"),
    (["train.eval_head_tokens=null"], 0, r"^train\.eval_head_tokens: expected an integer"),
    (["train.eval_head_tokens=true"], 0, r"^train\.eval_head_tokens: expected an integer"),
    (["train.eval_walk=1"], 0, r"^train\.eval_walk: expected true/false, got int 1$"),
    (["train.eval_walk=maybe"], 0, r"^train\.eval_walk: expected true/false"),
    (["drafter.anchor_sampling=sequence"], 0, r"^drafter\.anchor_sampling: must be one of \['row', 'conversation'\]"),
    (["drafter.anchors_per_conversation=64"], 0,
     r"^drafter\.anchors_per_conversation: applies only to drafter\.anchor_sampling: conversation \(got anchor_sampling: row\)"),
    (["drafter.anchor_sampling=conversation", "drafter.anchors_per_conversation=0"], 0,
     r"^drafter\.anchors_per_conversation: must be >= 1 or null \(no cap\), got 0$"),
    (["drafter.loss_weighting=focal"], 0, r"^drafter\.loss_weighting: must be one of \['decay', 'dpace'\]"),
    (["drafter.loss_weighting=dpace", "drafter.loss_gamma=7"], 0,
     r"^drafter\.loss_gamma: applies only to drafter\.loss_weighting: decay \(got loss_weighting: dpace\)"),
    (["drafter.loss_weighting=decay", "drafter.dpace_alpha=0.5"], 0,
     r"^drafter\.dpace_alpha: applies only to drafter\.loss_weighting: dpace"),
    (["drafter.loss_weighting=dpace", "drafter.dpace_alpha=1.5"], 0, r"^drafter\.dpace_alpha: must be in \[0, 1\], got 1\.5$"),
    (["data.extra_datasets=[/tmp]"], 0, r"^data\.extra_datasets\[0\]: /tmp is a directory \(give the JSONL file in it\)$"),
    (["data.extra_datasets=[sharegpt, /no/such/rows.jsonl]"], 0,
     r"^data\.extra_datasets\[1\]: no such file: /no/such/rows\.jsonl \(use 'sharegpt' or a JSONL path\)$"),
    (["data.extra_token_ratio=1.0"], 0,
     r"^data\.extra_token_ratio: samples data\.extra_datasets, which is empty \(set data\.extra_token_ratio=null too\)$"),
    (["data.extra_datasets=[sharegpt]", "data.extra_token_ratio=0"], 0,
     r"^data\.extra_token_ratio: must be a finite number > 0 \(or null: every extra row\), got 0"),
    (["data.extra_datasets=[sharegpt]", "data.extra_token_ratio=.inf"], 0,
     r"^data\.extra_token_ratio: must be a finite number > 0 \(or null: every extra row\), got inf"),
    (["data.tokenize_workers=0"], 0, r"^data\.tokenize_workers: must be >= 1 \(or null: by the data's size\), got 0"),
    (["drafter.label_chain=true", "drafter.labels=data"], 0,
     r"^drafter\.label_chain: applies only to drafter\.labels: target .*got labels: data\)$"),
    (["drafter.distillation=1.5"], 0, r"^drafter\.distillation: must be in \[0, 1\], got 1\.5$"),
    (["drafter.distillation=-0.1"], 0, r"^drafter\.distillation: must be in \[0, 1\], got -0\.1$"),
    (["drafter.distillation=0.5", "drafter.loss_weighting=dpace"], 0,
     r"^drafter\.distillation: applies only to drafter\.loss_weighting: decay"),
    (["drafter.gradient_checkpointing=yes please"], 0,
     r"^drafter\.gradient_checkpointing: expected true/false, got str 'yes please'$"),
    (["drafter.gradient_checkpointing=1"], 0, r"^drafter\.gradient_checkpointing: expected true/false, got int 1$"),
    (["drafter.checkpoint_layers=1"], 0,
     r"^drafter\.checkpoint_layers: applies only with drafter\.gradient_checkpointing: true"),
    (["drafter.gradient_checkpointing=true", "drafter.checkpoint_layers=9"], 0,
     r"^drafter\.checkpoint_layers: must be null \(every layer\) or 0 \.\.\. drafter\.num_layers \(\d+\), got 9$"),
    (["drafter.gradient_checkpointing=true", "drafter.checkpoint_layers=-1"], 0,
     r"^drafter\.checkpoint_layers: must be null"),
    (["drafter.compile=true", "drafter.activation_memory_budget=0"], 0,
     r"^drafter\.activation_memory_budget: must be in \(0, 1\] or null, got 0"),
    (["drafter.compile=true", "drafter.activation_memory_budget=1.5"], 0,
     r"^drafter\.activation_memory_budget: must be in \(0, 1\] or null, got 1\.5$"),
    (["drafter.compile=false", "drafter.activation_memory_budget=0.3"], 0,
     r"^drafter\.activation_memory_budget: applies only with drafter\.compile: true"),
]


@pytest.mark.parametrize("overrides,gpus,pattern", BAD_CASES, ids=[c[2][1:30] for c in BAD_CASES])
def test_bad_config_names_the_key(overrides, gpus, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(CONFIGS / "smollm2-135m-cpu.yaml", overrides, gpu_count=gpus)


def test_shared_gpu_allowed_when_asked():
    cfg = load_config(CONFIGS / "h200-2gpu.yaml",
                      ["cluster.targets=[0]", "cluster.drafters=[0]", "cluster.allow_shared_gpu=true"], gpu_count=1)
    assert cfg.cluster.targets == cfg.cluster.drafters == [0]


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^--config: no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter: [1, 2\n")
    with pytest.raises(ConfigError, match=r"^--config: .* is not valid YAML"):
        load_config(bad)
    section = tmp_path / "section.yaml"
    section.write_text("drafter: 3\n")
    with pytest.raises(ConfigError, match=r"^drafter: expected a section"):
        load_config(section)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["drafter.block_size"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["drafter..x=1"])
    assert parse_overrides(["a.b=1", "a.c=[1, 2]", "d=x"]) == {"a": {"b": 1, "c": [1, 2]}, "d": "x"}


def test_default_config_is_valid_on_cpu():
    validate_config(RunConfig(), gpu_count=0)


def test_default_gamma_matches_paper_points():
    assert default_gamma(16) == 7.0
    assert default_gamma(10) == 5.0
    assert default_gamma(8) == 4.0
    assert 4.0 < default_gamma(9) < 5.0
    assert default_gamma(2) >= 1.0


@pytest.mark.parametrize("value, expected", [("0", 0), ("null", None), ("3", 3)])
def test_eval_batches_zero_means_off_and_null_all(value, expected):
    cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml", [f"train.eval_batches={value}"], gpu_count=0)
    assert cfg.train.eval_batches == expected


def test_anchor_sampling_and_loss_weighting_keys():
    cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml", gpu_count=0)
    assert (cfg.drafter.anchor_sampling, cfg.drafter.anchors_per_conversation) == ("row", None)
    assert (cfg.drafter.loss_weighting, cfg.drafter.dpace_alpha, cfg.drafter.loss_gamma) == ("dpace", None, None)
    cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml",
                      ["drafter.anchor_sampling=conversation", "drafter.anchors_per_conversation=512",
                       "drafter.dpace_alpha=0.3"], gpu_count=0)
    assert (cfg.drafter.anchor_sampling, cfg.drafter.anchors_per_conversation) == ("conversation", 512)
    assert cfg.drafter.loss_weighting == "dpace" and cfg.drafter.dpace_alpha == pytest.approx(0.3)
    cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml", ["drafter.loss_weighting=decay", "drafter.loss_gamma=3"],
                      gpu_count=0)
    assert (cfg.drafter.loss_weighting, cfg.drafter.loss_gamma) == ("decay", 3.0)


def test_gradient_checkpointing_key():
    assert load_config(CONFIGS / "smollm2-135m-cpu.yaml", gpu_count=0).drafter.gradient_checkpointing is False
    for name, gpus in (("smollm2-135m-cpu", 0), ("h200-2gpu", 2)):
        cfg = load_config(CONFIGS / f"{name}.yaml", ["drafter.gradient_checkpointing=true"], gpu_count=gpus)
        assert cfg.drafter.gradient_checkpointing is True


def test_eval_head_tokens_defaults_to_the_decoding_checks_new_tokens():
    from dflash.inference.speculative import DEFAULT_MAX_NEW_TOKENS

    cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml", [], gpu_count=0)
    assert cfg.train.eval_head_tokens == DEFAULT_MAX_NEW_TOKENS
    assert load_config(CONFIGS / "smollm2-135m-cpu.yaml", ["train.eval_head_tokens=1"],
                       gpu_count=0).train.eval_head_tokens == 1
    assert cfg.train.eval_walk is True
    assert load_config(CONFIGS / "smollm2-135m-cpu.yaml", ["train.eval_walk=false"], gpu_count=0).train.eval_walk is False


def test_hf_target_without_weights_and_bad_peak_env_refused(tmp_path, monkeypatch):
    from dflash.config import ConfigError, load_config

    configs = Path(__file__).resolve().parent.parent / "configs"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^target\.path: .* holds no weights"):
        load_config(configs / "smollm2-135m-cpu.yaml", ["target.kind=hf", f"target.path={tmp_path}"], gpu_count=0)
    monkeypatch.setenv("DFLASH_PEAK_TFLOPS", "abc")
    with pytest.raises(ConfigError, match=r"^DFLASH_PEAK_TFLOPS: expected a positive number"):
        load_config(configs / "smollm2-135m-cpu.yaml", [], gpu_count=0)
