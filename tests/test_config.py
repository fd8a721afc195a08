"""The recipe loader: precedence, block discovery, validation messages, round trips."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recovery.recipe import (
    RESERVED_ENV,
    CheckpointlessConfig,
    ConfigError,
    all_fields,
    config_from_json,
    config_to_json,
    config_to_yaml,
    load_config,
)
from recovery.recipe.fields import fields_by_env
from replication import contract

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "examples" / "recipes"


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(exc_info: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [str(p) for p in exc_info.value.problems]


# --- defaults and precedence -------------------------------------------------------


def test_defaults_without_any_source():
    assert load_config(env={}) == CheckpointlessConfig()


def test_precedence_defaults_recipe_env_command_line(tmp_path):
    recipe = write(tmp_path, "checkpointless: {replication: {factor: 3, every_n_steps: 7}}")
    assert load_config(recipe, env={}).replication.factor == 3
    env = {"CHECKPOINTLESS_REPLICATION_FACTOR": "4"}
    assert load_config(recipe, env=env).replication.factor == 4
    cfg = load_config(recipe, ["replication.factor=5"], env=env)
    assert cfg.replication.factor == 5
    assert cfg.replication.every_n_steps == 7  # untouched keys keep the recipe's value
    assert cfg.replication.placement == "ring"  # and the rest keep the defaults


def test_later_override_wins_and_prefix_is_optional():
    cfg = load_config(None, ["replication.factor=3", "checkpointless.replication.factor=4"], env={})
    assert cfg.replication.factor == 4


def test_a_single_override_string_is_not_split_into_characters():
    assert load_config(None, "replication.factor=3", env={}).replication.factor == 3


def test_top_level_run_dir_from_every_source(tmp_path):
    recipe = write(tmp_path, "checkpointless: {run_dir: /from/recipe}")
    assert load_config(recipe, env={}).run_dir == "/from/recipe"
    assert load_config(recipe, env={"CHECKPOINTLESS_RUN_DIR": "/env"}).run_dir == "/env"
    assert load_config(recipe, ["run_dir=/cli"], env={}).run_dir == "/cli"


# --- finding the block ---------------------------------------------------------------


def test_nested_block_with_interpolations(tmp_path):
    recipe = write(
        tmp_path,
        """
        name: exp1
        trainer: {devices: 8, val_check_interval: 50}
        model: {hidden: 4096}
        exp_manager:
          explicit_log_dir: /results/${name}
          checkpointless:
            run_dir: ${exp_manager.explicit_log_dir}/cl
            persistence:
              path: /ckpt/${name}
              every_n_steps: ${trainer.val_check_interval}
        """,
    )
    cfg = load_config(recipe, env={})
    assert cfg.run_dir == "/results/exp1/cl"
    assert cfg.persistence.path == "/ckpt/exp1"
    assert cfg.persistence.every_n_steps == 50


def test_block_inside_a_list(tmp_path):
    recipe = write(
        tmp_path,
        """
        trainer:
          plugins:
            - {_target_: some.Plugin}
            - checkpointless: {replication: {factor: 3}}
        """,
    )
    assert load_config(recipe, env={}).replication.factor == 3


def test_block_that_is_itself_an_interpolation(tmp_path):
    recipe = write(
        tmp_path,
        """
        base: {replication: {factor: 4}}
        exp_manager: {checkpointless: "${base}"}
        """,
    )
    assert load_config(recipe, env={}).replication.factor == 4


def test_empty_block_means_defaults(tmp_path):
    recipe = write(tmp_path, "checkpointless:\n")
    assert load_config(recipe, env={}) == CheckpointlessConfig()


def test_unresolvable_interpolation_elsewhere_in_the_file_is_ignored(tmp_path):
    recipe = write(
        tmp_path,
        """
        model: {layers: "${nemo_only_resolver:1,2}", missing: "${does.not.exist}"}
        checkpointless: {replication: {factor: 3}}
        """,
    )
    assert load_config(recipe, env={}).replication.factor == 3


def test_unresolvable_interpolation_inside_the_block_is_a_config_error(tmp_path):
    recipe = write(tmp_path, "checkpointless: {run_dir: '${does.not.exist}'}")
    with pytest.raises(ConfigError, match="cannot resolve"):
        load_config(recipe, env={})


def test_two_blocks_are_refused_naming_both(tmp_path):
    recipe = write(
        tmp_path,
        """
        exp_manager: {checkpointless: {replication: {factor: 2}}}
        trainer: {plugins: [{checkpointless: {}}]}
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(recipe, env={})
    message = str(info.value)
    assert "exp_manager.checkpointless" in message
    assert "trainer.plugins[0].checkpointless" in message
    assert str(recipe) in message


def test_file_without_a_block(tmp_path):
    recipe = write(tmp_path, "model: {hidden: 1}\n")
    with pytest.raises(ConfigError, match="no 'checkpointless:' block"):
        load_config(recipe, env={})


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    recipe = write(tmp_path, "checkpointless:\n  replication: {factor: 2\n  memory: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(recipe, env={})
    message = str(info.value)
    assert str(recipe) in message
    assert "not valid YAML" in message
    assert "line " in message


def test_duplicate_yaml_keys_are_refused(tmp_path):
    recipe = write(tmp_path, "checkpointless:\n  replication: {}\n  replication: {}\n")
    with pytest.raises(ConfigError, match="duplicate key"):
        load_config(recipe, env={})


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"- just\n- a list\n", b"42\n"])
def test_odd_files_give_config_errors(tmp_path, content):
    recipe = tmp_path / "odd.yaml"
    recipe.write_bytes(content)
    with pytest.raises(ConfigError):
        load_config(recipe, env={})


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", env={})


# --- validation messages ------------------------------------------------------------


def test_unknown_key_suggests_the_closest(tmp_path):
    recipe = write(tmp_path, "checkpointless: {replication: {factr: 2}}")
    with pytest.raises(ConfigError) as info:
        load_config(recipe, env={})
    (problem,) = problems_of(info)
    assert "checkpointless.replication.factr: unknown key" in problem
    assert "did you mean 'checkpointless.replication.factor'?" in problem
    assert str(recipe) in problem


def test_right_name_in_the_wrong_section_is_suggested():
    with pytest.raises(ConfigError, match=r"did you mean 'checkpointless\.replication\.factor'"):
        load_config(None, ["factor=3"], env={})


def test_unknown_section_lists_valid_keys_when_nothing_is_close():
    with pytest.raises(ConfigError, match="valid top-level keys: run_dir, replication"):
        load_config(None, ["zzzz.q=1"], env={})


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("replication.factor=0", "got '0'; expected an integer in [1, 8]"),
        ("replication.factor=9", "expected an integer in [1, 8]"),
        ("replication.factor=2.5", "not a whole number"),
        ("replication.factor=true", "expected an integer"),
        ("replication.factor=abc", "got 'abc'; expected an integer"),
        ("replication.placement=rnig", "expected one of 'ring', 'spread'"),
        ("memory.available_fraction=1.5", "expected a number in [0.01, 1.0]"),
        ("memory.available_fraction=.inf", "not a finite number"),
        ("replication.timeout_s=1" + "0" * 400, "not a finite number"),
        ("replication.factor=" + "9" * 5000, "expected an integer"),
        ("recovery.enabled=maybe", "expected a boolean"),
        ("persistence.storage_options=[1, 2]", "expected a mapping"),
        ("replication.factor.sub=1", "not a mapping; it has no sub-keys"),
        ("replication=3", "expected a mapping (the replication section)"),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], env={})
    (problem,) = problems_of(info)
    key = "checkpointless." + override.split("=")[0].rsplit(".sub", 1)[0]
    assert problem.startswith(key)
    assert fragment in problem
    assert f"command line {override!r}"[:80] in problem  # long values are shortened


@pytest.mark.parametrize(
    ("yaml_value", "fragment"),
    [
        ("'3'", None),  # numeric strings (e.g. from ${oc.env:...}) are accepted
        ("3.0", None),  # integral floats are whole numbers
        ("true", "got boolean True"),
        ("[3]", "got list [3]"),
        ("{a: 1}", "got dict"),
    ],
)
def test_recipe_types_for_int_field(tmp_path, yaml_value, fragment):
    recipe = write(tmp_path, f"checkpointless: {{replication: {{factor: {yaml_value}}}}}")
    if fragment is None:
        assert load_config(recipe, env={}).replication.factor == 3
        return
    with pytest.raises(ConfigError, match=r"checkpointless\.replication\.factor") as info:
        load_config(recipe, env={})
    assert fragment in str(info.value)


@pytest.mark.parametrize("value", ["[a]", "{a: 1}", "12", "true"])
def test_recipe_string_fields_refuse_non_strings(tmp_path, value):
    recipe = write(tmp_path, f"checkpointless: {{persistence: {{path: {value}}}}}")
    with pytest.raises(ConfigError, match=r"checkpointless\.persistence\.path: got"):
        load_config(recipe, env={})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("TRUE", True), ("yes", True), ("1", True), ("No", False), ("false", False), ("0", False)],
)
def test_bool_words_are_case_insensitive(text, expected):
    env = {"CHECKPOINTLESS_RECOVERY_ENABLED": text}
    assert load_config(env=env).recovery.enabled is expected


def test_yaml_style_values_on_the_command_line():
    cfg = load_config(
        None,
        [
            "replication.chunk_bytes=1e6",
            "replication.timeout_s=30",
            "replication.dedupe=false",
            "persistence.path=s3://bucket/x",
            "persistence.every_n_steps=10",
            "persistence.storage_options.endpoint_url=http://localhost:9000",
            "persistence.storage_options.client_kwargs.region_name=us-east-1",
            "persistence.storage_options.anon=true",
            "persistence.storage_options.tags=[1,2]",
            "recovery.fault=0:5:forward",
        ],
        env={},
    )
    assert cfg.replication.chunk_bytes == 1_000_000
    assert isinstance(cfg.replication.chunk_bytes, int)
    assert cfg.replication.timeout_s == 30.0
    assert isinstance(cfg.replication.timeout_s, float)
    assert cfg.replication.dedupe is False
    assert cfg.persistence.path == "s3://bucket/x"
    assert cfg.persistence.storage_options == {
        "endpoint_url": "http://localhost:9000",
        "client_kwargs": {"region_name": "us-east-1"},
        "anon": True,
        "tags": [1, 2],
    }
    assert cfg.recovery.fault == "0:5:forward"  # not read as a sexagesimal number


def test_storage_option_sub_keys_merge_with_the_recipe(tmp_path):
    recipe = write(
        tmp_path,
        """
        checkpointless:
          persistence: {storage_options: {endpoint_url: http://a, anon: false}}
        """,
    )
    cfg = load_config(recipe, ["persistence.storage_options.anon=true"], env={})
    assert cfg.persistence.storage_options == {"endpoint_url": "http://a", "anon": True}
    cfg = load_config(recipe, ["persistence.storage_options={key: k}"], env={})
    assert cfg.persistence.storage_options == {"key": "k"}  # a whole mapping replaces


def test_override_without_equals_is_named():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["replication.factor"], env={})
    assert "'replication.factor': not an override (expected key=value)" in str(info.value)


def test_all_problems_are_reported_together_each_with_its_source(tmp_path):
    recipe = write(tmp_path, "checkpointless: {replication: {factor: 0, placment: ring}}")
    env = {"CHECKPOINTLESS_MEMORY_HOST_BUDGET_BYTES": "-1", "CHECKPOINTLESS_REPLICATON_X": "1"}
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ["recovery.abort_backend=mpi", "nonsense"], env=env)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid configuration (6 problems):"
    body = "\n".join(lines[1:])
    assert len(lines) == 7
    factor = "checkpointless.replication.factor: got 0; expected an integer in [1, 8]"
    assert f"{factor} (from recipe {recipe})" in body
    assert "checkpointless.replication.placment: unknown key" in body
    assert "(from env CHECKPOINTLESS_MEMORY_HOST_BUDGET_BYTES)" in body
    assert "CHECKPOINTLESS_REPLICATON_X: unknown configuration variable" in body
    assert "(from command line 'recovery.abort_backend=mpi')" in body
    assert "'nonsense': not an override" in body


def test_nested_block_source_names_the_block(tmp_path):
    recipe = write(tmp_path, "exp_manager: {checkpointless: {replication: {factor: 0}}}")
    with pytest.raises(ConfigError, match=r"block exp_manager\.checkpointless\)"):
        load_config(recipe, env={})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- cross-field checks -------------------------------------------------------------


@pytest.mark.parametrize("override", ["persistence.every_n_steps=5", "persistence.interval_s=60"])
def test_periodic_persistence_needs_a_path(override):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], env={})
    message = str(info.value)
    assert "checkpointless.persistence." + override.split(".")[1].split("=")[0] in message
    assert "checkpointless.persistence.path is empty" in message
    cfg = load_config(None, [override, "persistence.path=/tmp/ck"], env={})
    assert cfg.persistence.path == "/tmp/ck"


def test_heartbeat_timeout_must_exceed_interval():
    with pytest.raises(ConfigError, match=r"heartbeat_timeout_s: got 1\.0; must be greater than"):
        load_config(
            None, ["recovery.heartbeat_timeout_s=1", "recovery.heartbeat_interval_s=1"], env={}
        )


@pytest.mark.parametrize("fault", ["x", "1:2", "a:1:forward", "1:2:3:4:5", "1::x"])
def test_malformed_fault_spec(fault):
    with pytest.raises(ConfigError, match="rank:step:phase"):
        load_config(None, [f"recovery.fault={fault}"], env={})


def test_cross_check_is_skipped_when_a_field_is_already_bad(tmp_path):
    recipe = write(tmp_path, "checkpointless: {persistence: {path: [1], every_n_steps: 5}}")
    with pytest.raises(ConfigError) as info:
        load_config(recipe, env={})
    (problem,) = problems_of(info)  # the bad path only, not also "needs a path"
    assert problem.startswith("checkpointless.persistence.path: got list [1]")


def test_text_sources_keep_string_fields_verbatim():
    cfg = load_config(None, ["persistence.path=[1]", "persistence.every_n_steps=5"], env={})
    assert cfg.persistence.path == "[1]"
    overrides = ["persistence.path=/a #b ", "run_dir='x #y'", "recovery.events_file=null"]
    cfg = load_config(None, overrides, env={})
    assert cfg.persistence.path == "/a #b "
    assert cfg.run_dir == "x #y"
    assert cfg.recovery.events_file == "null"  # not nullable: the text is the value


# --- environment --------------------------------------------------------------------


def test_env_vars_set_fields():
    env = {
        "CHECKPOINTLESS_REPLICATION_EVERY_N_STEPS": "2",
        "CHECKPOINTLESS_MEMORY_HOST_BUDGET_BYTES": "1000",
        "CHECKPOINTLESS_DATALOADER_CACHE_ENABLED": "no",
        "CHECKPOINTLESS_PERSISTENCE_PATH": "s3://b/p",
        "CHECKPOINTLESS_PERSISTENCE_STORAGE_OPTIONS": "{anon: true}",
        "CHECKPOINTLESS_PERSISTENCE_STORAGE_OPTIONS_ENDPOINT_URL": "http://e",
        "UNRELATED": "x",
    }
    cfg = load_config(env=env)
    assert cfg.replication.every_n_steps == 2
    assert cfg.memory.host_budget_bytes == 1000
    assert cfg.dataloader_cache.enabled is False
    assert cfg.persistence.path == "s3://b/p"
    assert cfg.persistence.storage_options == {"anon": True, "endpoint_url": "http://e"}


def test_reserved_env_vars_are_ignored():
    env = dict.fromkeys(RESERVED_ENV, "{not: [valid")
    env["CHECKPOINTLESS_INTERNAL_GENERATION"] = "7"
    env["CHECKPOINTLESS_INTERNAL_anything"] = "x"
    assert load_config(env=env) == CheckpointlessConfig()
    assert {"CHECKPOINTLESS_RECIPE", "CHECKPOINTLESS_OVERRIDES",
            contract.ENV_CONFIG} <= RESERVED_ENV


def test_unknown_env_var_is_named_with_suggestions():
    with pytest.raises(ConfigError) as info:
        load_config(env={"CHECKPOINTLESS_REPLICATION_FACTR": "2"})
    (problem,) = problems_of(info)
    assert problem.startswith("CHECKPOINTLESS_REPLICATION_FACTR: unknown configuration variable")
    assert "did you mean 'CHECKPOINTLESS_REPLICATION_FACTOR'?" in problem


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match=r"\(from env CHECKPOINTLESS_REPLICATION_FACTOR\)"):
        load_config(env={"CHECKPOINTLESS_REPLICATION_FACTOR": "two"})


def test_env_names_are_unique_and_cover_every_field():
    assert len(fields_by_env()) == len(all_fields())
    assert "CHECKPOINTLESS_RUN_DIR" in fields_by_env()


def test_os_environ_is_the_default(monkeypatch):
    monkeypatch.setenv("CHECKPOINTLESS_REPLICATION_FACTOR", "3")
    assert load_config().replication.factor == 3


# --- serialisation ------------------------------------------------------------------


def _custom_config() -> CheckpointlessConfig:
    return load_config(
        None,
        [
            "run_dir=/r/${not_an_interpolation}",
            "replication.factor=3",
            "persistence.path=s3://b/k: v #x",
            "persistence.every_n_steps=4",
            "persistence.storage_options.endpoint_url=http://x",
            "persistence.storage_options.n={a: [1, 2.5, null]}",
            "recovery.fault=1:2:backward:sigkill",
            "memory.available_fraction=0.25",
        ],
        env={},
    )


def test_yaml_round_trip(tmp_path):
    cfg = _custom_config()
    text = config_to_yaml(cfg)
    assert text.startswith("checkpointless:\n")
    recipe = write(tmp_path, text)
    assert load_config(recipe, env={}) == cfg


def test_yaml_with_comments_round_trips_too(tmp_path):
    cfg = _custom_config()
    text = config_to_yaml(cfg, comments=True)
    assert "# copies of each rank's state" in text
    assert load_config(write(tmp_path, text), env={}) == cfg


def test_json_round_trip():
    cfg = _custom_config()
    text = config_to_json(cfg)
    assert json.loads(text)["replication"]["factor"] == 3
    assert config_from_json(text) == cfg


def test_config_from_json_validates():
    with pytest.raises(ConfigError, match="not valid JSON"):
        config_from_json("{")
    with pytest.raises(
        ConfigError, match=r"checkpointless.replication.factor.*CHECKPOINTLESS_CONFIG_JSON"
    ):
        config_from_json('{"replication": {"factor": 99}}')


def test_to_dict_is_a_deep_copy():
    cfg = CheckpointlessConfig()
    d = cfg.to_dict()
    d["persistence"]["storage_options"]["x"] = 1
    assert cfg.persistence.storage_options == {}
    assert list(d) == [f.name for f in dataclasses.fields(CheckpointlessConfig)]


# --- shipped examples ---------------------------------------------------------------


def test_default_recipe_matches_the_code():
    """examples/recipes/default.yaml must list every key at its real default."""
    assert load_config(RECIPES / "default.yaml", env={}) == CheckpointlessConfig()
    block = yaml.safe_load((RECIPES / "default.yaml").read_text())["checkpointless"]
    listed = {(s, k) for s, v in block.items() if isinstance(v, dict) for k in v}
    listed |= {(k,) for k, v in block.items() if not isinstance(v, dict)}
    assert listed == {spec.path for spec in all_fields()}


def test_nemo_nested_recipe_loads():
    cfg = load_config(RECIPES / "nemo_nested.yaml", env={})
    assert cfg.run_dir == "/results/llama3_8b_pretrain/checkpointless"
    assert cfg.persistence.path == "s3://my-bucket/checkpoints/llama3_8b_pretrain"
    assert cfg.persistence.every_n_steps == 1000


# --- robustness ---------------------------------------------------------------------

_KEYS = [".".join(spec.path) for spec in all_fields()]
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)
_big_ints = st.integers(min_value=-(10**400), max_value=10**400)
_scalars = st.none() | st.booleans() | st.integers() | _big_ints | st.floats() | _text
_yamlish = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(_KEYS) | _text | st.integers(), children, max_size=4)
    ),
    max_leaves=20,
)
_overrides = st.one_of(
    _text,
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(_KEYS) | _text, _text),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(_KEYS), _yamlish.map(json.dumps)),
)
_robust = settings(
    max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _loads_or_config_error(*args, **kwargs) -> None:
    try:
        cfg = load_config(*args, **kwargs)
    except ConfigError as exc:
        assert exc.problems
        assert str(exc)
        return
    assert isinstance(cfg, CheckpointlessConfig)
    assert config_from_json(config_to_json(cfg)) == cfg


@_robust
@given(st.lists(_overrides, max_size=5))
def test_garbage_overrides_only_ever_raise_config_error(overrides):
    _loads_or_config_error(None, overrides, env={})


@_robust
@given(st.dictionaries(st.sampled_from(sorted(fields_by_env())) | _text, _text, max_size=4))
def test_garbage_env_only_ever_raises_config_error(env):
    env = {"CHECKPOINTLESS_" + k.removeprefix("CHECKPOINTLESS_"): v for k, v in env.items()}
    _loads_or_config_error(None, (), env=env)


def _section_tree():
    fields = st.dictionaries(st.sampled_from(_KEYS).map(lambda k: k.split(".")[-1]), _yamlish)
    return st.dictionaries(
        st.sampled_from(["run_dir", "replication", "persistence", "recovery", "memory", "x"]),
        fields | _yamlish,
        max_size=4,
    )


@_robust
@given(st.one_of(_section_tree(), _yamlish))
def test_garbage_recipes_only_ever_raise_config_error(tmp_path, block):
    try:
        text = yaml.safe_dump({"wrapper": {"checkpointless": block}}, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return
    recipe = tmp_path / "garbage.yaml"
    recipe.write_text(text, encoding="utf-8")
    _loads_or_config_error(recipe, (), env={})


@_robust
@given(st.binary(max_size=200))
def test_garbage_files_only_ever_raise_config_error(tmp_path, content):
    recipe = tmp_path / "bytes.yaml"
    recipe.write_bytes(content)
    _loads_or_config_error(recipe, (), env={})


@_robust
@given(_yamlish)
def test_garbage_json_only_ever_raises_config_error(data):
    try:
        text = json.dumps(data)
    except ValueError:
        return
    try:
        config_from_json(text)
    except ConfigError:
        pass


def test_non_finite_floats_are_refused_everywhere(tmp_path):
    recipe = write(tmp_path, "checkpointless: {replication: {timeout_s: .nan}}")
    with pytest.raises(ConfigError, match="not a finite number"):
        load_config(recipe, env={})
    assert math.isfinite(load_config(env={}).replication.timeout_s)


def test_lone_surrogates_are_refused_by_name():
    """YAML and JSON escapes can spell lone surrogates, which no path can hold and which
    a JSON round trip would turn into another string (hypothesis found this)."""
    for override in ('run_dir="\\uD800\\uDC00"',
                     'persistence.storage_options={"key": "\\ud800"}'):
        with pytest.raises(ConfigError, match="lone surrogate") as info:
            load_config(None, [override], env={})
        assert override.split("=")[0] in str(info.value)
