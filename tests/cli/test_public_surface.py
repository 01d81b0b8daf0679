"""``yoke``'s public surface: the names outside code may use, resolved without heavy imports."""

from __future__ import annotations

import importlib
import subprocess
import sys

import yoke

PUBLIC = {
    "Client": "yoke.client",
    "create_agent": "yoke.runtime.joins",
    "create_forum": "yoke.runtime.joins",
    "join_conversation": "yoke.runtime.joins",
    "leave_conversation": "yoke.runtime.joins",
    "Tool": "yoke.tools.base",
    "ToolContext": "yoke.tools.base",
    "Message": "yoke.core.models",
    "Envelope": "yoke.core.models",
    "MessagePosted": "yoke.core.models",
    "AgentActivity": "yoke.core.models",
    "SubmitMessage": "yoke.core.models",
    "SubmitReply": "yoke.core.models",
    "ToolCallRequest": "yoke.core.models",
    "SubmitToolResult": "yoke.core.models",
    "ApprovalRequested": "yoke.core.models",
    "ApprovalDecided": "yoke.core.models",
    "SubmitApproval": "yoke.core.models",
    "Part": "yoke.core.models",
    "TextPart": "yoke.core.models",
    "ToolCallPart": "yoke.core.models",
    "ToolResultPart": "yoke.core.models",
    "publisher_permissions": "yoke.bus.topology",
    "signature_matches": "yoke.store.webhooks",
}
HEAVY = ("aio_pika", "aiormq", "pymongo", "openai", "fastapi", "httpx", "prometheus_client")


def test_all_names_exactly_the_public_names_and_the_version() -> None:
    assert sorted(yoke.__all__) == sorted([*PUBLIC, "__version__"])


def test_each_public_name_is_the_object_its_module_defines() -> None:
    for name, module in PUBLIC.items():
        assert getattr(yoke, name) is getattr(importlib.import_module(module), name), name
    assert set(yoke.__all__) <= set(dir(yoke))


def test_the_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    assert yoke.__version__ == version("yoke-mesh")


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        yoke.Clinet  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert "Clinet" in str(error)
    else:
        raise AssertionError("yoke.Clinet resolved")


def test_import_yoke_loads_no_broker_database_model_or_http_library() -> None:
    script = (
        "import sys, yoke, yoke.core.models\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
