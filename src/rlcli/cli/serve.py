"""`rlcli serve`: a policy behind an OpenAI-compatible endpoint on 127.0.0.1, until Ctrl-C."""

from __future__ import annotations

import signal
import threading
from typing import Annotated

import typer

from rlcli.cli.common import RecipeOpt, RunOpt, console
from rlcli.cli.envs import model_checkpoint
from rlcli.console import err_console
from rlcli.errors import UsageError

app = typer.Typer()


@app.command("serve")
def serve_cmd(
    cli_ctx: typer.Context,
    recipe: RecipeOpt = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            "-c",
            help="A checkpoint folder, or base, sft, latest, best or a checkpoint id of --run (whose recipe is "
            "then used unless --recipe is given). Default: base.",
            show_default=False,
        ),
    ] = None,
    run: RunOpt = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A hub id, local folder or short name instead of the recipe's model.name.",
            show_default=False,
        ),
    ] = None,
    port: Annotated[int, typer.Option(help="The port on 127.0.0.1 (0: a free one, printed).")] = 0,
) -> None:
    """Serve a policy as an OpenAI-compatible endpoint (chat completions, tools, streaming) on 127.0.0.1.

    Prints the base URL and the model name on stdout, then serves until Ctrl-C. Replies are sampled as
    rollouts sample (the recipe's engine, temperature, token cap and context length); a request's own
    temperature, top_p, max_tokens and stop apply to it.

    Examples:
      rlcli serve -r quickstart  # the base model
      rlcli serve -r quickstart -c best --port 8011
      OPENAI_BASE_URL=http://127.0.0.1:8011/v1 OPENAI_API_KEY=unused python my_agent.py
    """
    from rlcli.engine.serve import start_endpoint
    from rlcli.recipe import load_recipe

    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a port number; expected 0 (a free port) to 65535.")
    loaded = load_recipe(recipe, [f"model.name={model}"] if model else [])
    loaded, folder = model_checkpoint(cli_ctx, loaded, recipe is not None, model, checkpoint, run)
    endpoint = start_endpoint(loaded, folder, port)
    console.print(f"base_url: {endpoint.url()}", highlight=False, soft_wrap=True)
    console.print(f"model: {endpoint.model_name}", highlight=False, soft_wrap=True)
    console.file.flush()  # a program reading the URL waits for it, not for the end
    err_console.print("serving; Ctrl-C stops", highlight=False)
    # Started with SIGINT ignored (a script's background job, or a parent that ignores it), Python would
    # keep ignoring it and nothing would stop the server but a kill: Ctrl-C and `kill -INT` stop it always.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Event().wait()  # the endpoint's threads serve; this one waits for Ctrl-C
    except KeyboardInterrupt:
        err_console.print("stopped", highlight=False)
    finally:
        endpoint.close()
