"""The checked-in list of SGLang 0.5.23's server flags (``tinylm/sglang_server_args.py``).

The list is extracted from SGLang's source by ``scripts/sglang_server_args.py``, statically:
``srt/server_args.py`` (``_INPUT_NAMESPACES``, ``ServerArgs.add_cli_args``) and
``srt/arg_groups/fields/*.py`` read with the rules of ``srt/arg_groups/arg_utils.py``,
``add_cli_args_from_dataclass``. Where the SGLang source is unpacked (``/work/ref/sglang``), the
extraction is re-run and must give the checked-in module byte for byte; elsewhere (CI has no
SGLang) that test is skipped and the checked-in list is what the engine and tinylm use.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tinylm.sglang_server_args import FLAGS, SGLANG_VERSION

REPO = Path(__file__).resolve().parents[2]
SGLANG_SOURCE = Path("/work/ref/sglang/sglang")  # the unpacked 0.5.23 wheel, where present


def extractor() -> ModuleType:
    path = REPO / "scripts" / "sglang_server_args.py"
    spec = importlib.util.spec_from_file_location("sglang_server_args_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (SGLANG_SOURCE / "srt").is_dir(), reason="no SGLang source here")
def test_the_checked_in_list_is_what_the_source_gives() -> None:
    script = extractor()
    text = script.render(script.extract(SGLANG_SOURCE), script.version_of(SGLANG_SOURCE))
    assert text == (REPO / "tinylm" / "sglang_server_args.py").read_text()


def test_the_list_holds_the_flags_a_supervisor_passes() -> None:
    assert SGLANG_VERSION == "0.5.23"
    # serving.py / model.py fields; `--model` is model_path's alias (model.py, Arg.aliases).
    for flag, dest in (
        ("--model-path", "model_path"),
        ("--model", "model_path"),
        ("--host", "host"),
        ("--port", "port"),
        ("--weight-version", "weight_version"),
        ("--api-key", "api_key"),
        ("--admin-api-key", "admin_api_key"),
        ("--served-model-name", "served_model_name"),
        ("--tp-size", "tp_size"),
        ("--tensor-parallel-size", "tp_size"),
    ):
        assert FLAGS[flag] == (dest, None), flag
    assert FLAGS["--skip-server-warmup"] == ("skip_server_warmup", 0)  # a bool: store_true
    # argparse.BooleanOptionalAction registers --no-... too (exec_.py, enable_tf32_matmul).
    assert FLAGS["--no-enable-tf32-matmul"] == ("enable_tf32_matmul", 0)
    # Registered by hand in ServerArgs.add_cli_args: --config, deprecated spellings.
    assert FLAGS["--config"] == ("config", None)
    assert FLAGS["--enable-dp-attention"] == ("enable_dp_attention", 0)
    assert FLAGS["--monokernel-backend"] == ("enable_amd_monokernel", None)
    # no_cli fields have no flag; argparse's own --help is not listed.
    assert "--grpc-worker-threads" not in FLAGS and "--help" not in FLAGS
    assert all(flag.startswith("--") for flag in FLAGS)
    assert all(n in (0, None, "?", "*", "+") for _, n in FLAGS.values())


def test_tinylm_serve_accepts_every_sglang_flag_with_its_arity() -> None:
    from tinylm.cli import IMPLEMENTED, build_parser, ignored_flags

    parser = build_parser()
    values = {0: [], None: ["1"], "?": ["1"], "*": ["1", "2"], "+": ["1", "2"]}
    for flag, (dest, nargs) in FLAGS.items():
        if dest == "model_path":
            continue
        args = parser.parse_args(["serve", "--model-path", "m", flag, *values[nargs]])
        if dest in IMPLEMENTED:
            assert getattr(args, dest) is not None, flag
        else:
            assert ignored_flags(args) == [dest], flag
