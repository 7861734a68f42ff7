"""gymnasium:<EnvId> - a Gymnasium env whose observations and actions can be written as text.

Observations: when the env can render as text (render_mode "ansi": FrozenLake, Taxi, CliffWalking)
the agent sees that map, with terminal colours turned into tags (`<red>S</red>` marks the agent on
FrozenLake); otherwise the observation itself is written out: Discrete as its index, small 1-D
Box/MultiDiscrete/MultiBinary vectors as lists of numbers, Tuple and Dict of those (Blackjack's
(sum, dealer card, usable ace)), Text passed through. Each step's feedback adds the step's reward.
Actions: Discrete actions accept an index or, for the envs listed in KNOWN, an action name ("left");
the last one in the reply counts. Text actions pass the reply through. A reply that names no valid
action gets feedback listing the valid ones, without stepping the env, and the reward
`invalid_action_reward` (an adapter option in env.kwargs, default -1). At 0, junk would beat playing
wherever a step costs (Taxi, CliffWalking, MountainCar: -1 a step) or the expected return is
negative (Blackjack): replying junk until env.max_turns would avoid every cost.
Rewards and episode ends are the env's own (its time limit truncates). `info["success"]` at the end
follows the env's notion of success where KNOWN gives one (reaching the goal, surviving to the time
limit), and otherwise means: the env terminated with a positive last reward.
env.kwargs other than invalid_action_reward go to gymnasium.make (e.g. {is_slippery: false,
map_name: 8x8} for FrozenLake-v1).

Frames as images: `gymnasium:<EnvId>?render=image` makes the env with render_mode "rgb_array" and
adds its frame, as a PIL image part, to every observation (for vision-language models). The text
part keeps the observation written out and the step's reward; the text map of "ansi" renders is not
shown, and an observation with no text form (an image Box) is then left to the picture alone.

Limits: image observations without ?render=image, large vectors and continuous (Box) actions cannot
be expressed as text and are refused. No expert. Envs whose dependencies are not installed (Box2D,
MuJoCo, pygame for the toy-text frames) fail with gymnasium's own message.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, NamedTuple, cast
from urllib.parse import parse_qsl

import gymnasium
from gymnasium import spaces

from rlcli.envs.parsing import parse_last_number
from rlcli.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

MAX_VECTOR = 64  # more numbers than this per observation is not something to read as text
RENDERS = ("text", "image")  # the values of the URI option ?render=


class Known(NamedTuple):
    actions: list[str]  # names of the Discrete actions, in index order
    success: str  # "win": terminated with a positive reward; "goal": terminated; "survive": reached the time limit
    about: str
    picture: str = ""  # with ?render=image, what `about` says of the text map, said of the frame instead


KNOWN = {
    "FrozenLake": Known(
        ["left", "down", "right", "up"],
        "win",
        "Walk on the frozen lake from S to the goal G without falling into a hole H (F is safe "
        "ice). You are the <red>marked</red> cell. The ice can be slippery: a move may go sideways.",
        "Walk on the frozen lake from the start S to the goal G (the flag) without falling into a hole. The "
        "picture shows the lake from above: you are the figure, dark blue squares are holes. The ice can be "
        "slippery: a move may go sideways.",
    ),
    "Taxi": Known(
        ["south", "north", "east", "west", "pickup", "dropoff"],
        "goal",
        "Drive the taxi to the passenger, pick them up, and drop them off at their destination. On the map "
        "<yellow> is the empty taxi, <green> the taxi with the passenger, <blue> the passenger's stop and "
        "<magenta> the destination; '|' is a wall. Reward -1 per step, +20 for the right drop-off, -10 for "
        "an illegal pickup or drop-off.",
        "Drive the taxi to the passenger, pick them up, and drop them off at their destination. The picture "
        "shows the map from above: the taxi, the passenger waiting at one of the four coloured stops, the "
        "destination marked by the hotel, and dark lines for walls. Reward -1 per step, +20 for the right "
        "drop-off, -10 for an illegal pickup or drop-off.",
    ),
    "CliffWalking": Known(
        ["up", "right", "down", "left"],
        "goal",
        "Walk from the start to T along the grid. x is you, C is the cliff: stepping on it costs "
        "-100 and sends you back to the start. Reward -1 per step.",
        "Walk from the start S to the goal G (the flag) along the grid. The picture shows it from above: you "
        "are the figure, the brown strip is the cliff: stepping on it costs -100 and sends you back to the "
        "start. Reward -1 per step.",
    ),
    "Blackjack": Known(
        ["stick", "hit"],
        "win",
        "Play a hand of blackjack against the dealer. The observation is (your current sum, the "
        "dealer's showing card with 1 = ace, whether you hold a usable ace). Hit takes a card, stick "
        "stops. Reward +1 for a win, 0 for a draw, -1 for a loss.",
    ),
    "CartPole": Known(
        ["left", "right"],
        "survive",
        "Keep the pole on the cart upright by pushing the cart left or right. The observation is "
        "[cart position, cart velocity, pole angle in radians, pole angular velocity]. "
        "Reward +1 per step the pole stays up.",
    ),
    "MountainCar": Known(
        ["left", "none", "right"],
        "goal",
        "Drive the car up the right hill to the flag at position 0.5; its engine is too weak to go "
        "straight up, so build momentum. The observation is [position, velocity]; actions push left, "
        "not at all, or right. Reward -1 per step.",
    ),
}
KNOWN["FrozenLake8x8"] = KNOWN["FrozenLake"]
KNOWN["CliffWalkingSlippery"] = KNOWN["CliffWalking"]

_COLOURS = ["black", "red", "green", "yellow", "blue", "magenta", "cyan", "white"]
_COLOURED = re.compile(r"\x1b\[([\d;]*)m(.*?)\x1b\[0m", flags=re.S)
_ESCAPE = re.compile(r"\x1b\[[\d;]*m")


def ansi_to_text(rendered: str) -> str:
    """Terminal colours carry meaning in some renders (the taxi, the agent's cell): keep it as tags."""

    def tag(match: re.Match) -> str:
        codes = [int(c) for c in match.group(1).split(";") if c]
        colours = [_COLOURS[c % 10] for c in codes if 30 <= c <= 37 or 40 <= c <= 47]
        return f"<{colours[0]}>{match.group(2)}</{colours[0]}>" if colours else match.group(2)

    return _ESCAPE.sub("", _COLOURED.sub(tag, rendered)).strip("\n")


def describe(space: spaces.Space, value: Any) -> str:
    if isinstance(space, spaces.Text):
        return str(value)
    if isinstance(space, spaces.Discrete):
        return str(int(value))
    if isinstance(space, (spaces.MultiDiscrete, spaces.MultiBinary)):
        return "[" + ", ".join(str(int(v)) for v in value) + "]"
    if isinstance(space, spaces.Box):
        return "[" + ", ".join(f"{float(v):.4g}" for v in value.reshape(-1)) + "]"
    if isinstance(space, spaces.Tuple):
        return "(" + ", ".join(describe(s, v) for s, v in zip(space.spaces, value)) + ")"
    if isinstance(space, spaces.Dict):
        return "{" + ", ".join(f"{k}: {describe(s, value[k])}" for k, s in space.spaces.items()) + "}"
    raise TypeError(f"no text form for {space}")


def is_text_representable(space: spaces.Space) -> bool:
    if isinstance(space, (spaces.Text, spaces.Discrete)):
        return True
    if isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
        shape = space.shape or ()
        return len(shape) <= 1 and (shape[0] if shape else 1) <= MAX_VECTOR
    if isinstance(space, spaces.Tuple):
        return all(is_text_representable(s) for s in space.spaces)
    if isinstance(space, spaces.Dict):
        return all(is_text_representable(s) for s in space.spaces.values())
    return False


class GymnasiumEnv:
    def __init__(self, env_id: str, env: gymnasium.Env, invalid_action_reward: float = -1.0, image: bool = False):
        self.env_id, self.env, self.invalid_action_reward = env_id, env, float(invalid_action_reward)
        self.image = image  # each observation carries the env's rgb_array frame
        self.known = KNOWN.get(env.spec.name if env.spec else "")
        space = env.action_space
        if isinstance(space, spaces.Discrete):
            start, n = int(space.start), int(space.n)
            names = self.known.actions if self.known and len(self.known.actions) == n else []
            self.names = {name: start + i for i, name in enumerate(names)}
            choices = [f"{name} ({start + i})" for i, name in enumerate(names)] or [str(start + i) for i in range(n)]
            self.how_to_act = f"Each turn reply with one action: {', '.join(choices)}."
            self.valid = range(start, start + n)
        else:
            self.how_to_act = "Each turn reply with your action as text."

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        obs, _ = self.env.reset(seed=seed)
        about = self.known.about if self.known else f"You are acting in the Gymnasium environment {self.env_id}."
        if self.image:
            about = self.known.picture if self.known and self.known.picture else f"{about} The picture shows it."
        messages = [{"role": "system", "content": f"{about} {self.how_to_act}"}, self._user("", obs, "")]
        return messages, {"task": {"env_id": self.env_id, "seed": seed}}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        chosen = self._parse(action)
        if chosen is None:
            reward = self.invalid_action_reward
            feedback = self._user(f"Invalid action. {self.how_to_act}", self.last_obs, f"Reward: {reward:g}")
            return _reply(feedback), reward, False, False, {"valid": False}
        obs, raw_reward, terminated, truncated, _ = self.env.step(chosen)
        reward = float(raw_reward)
        after = f"Reward: {reward:g}"
        info: dict[str, Any] = {"valid": True}
        if terminated or truncated:
            info["success"] = self._success(reward, terminated, truncated)
            after += "\nThe episode is over."
        return _reply(self._user("", obs, after)), reward, bool(terminated), bool(truncated), info

    def _user(self, before: str, obs: Any, after: str) -> dict[str, Any]:
        """The user message showing `obs` between two texts; with ?render=image, the frame after them."""
        text = "\n".join(t for t in (before, self._show(obs), after) if t)
        if not self.image:
            return {"role": "user", "content": text}
        from PIL import Image

        frame = Image.fromarray(cast("np.ndarray", self.env.render()))  # render_mode rgb_array
        return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "image": frame}]}

    def _show(self, obs: Any) -> str:
        self.last_obs = obs
        if self.env.render_mode == "ansi":
            return ansi_to_text(cast(str, self.env.render()))
        if isinstance(self.env.observation_space, spaces.Text):
            return str(obs)
        if not is_text_representable(self.env.observation_space):
            return ""  # only with ?render=image (make_env refuses it otherwise): the frame shows it
        return f"Observation: {describe(self.env.observation_space, obs)}"

    def _parse(self, action: str) -> Any:
        if not isinstance(self.env.action_space, spaces.Discrete):
            return action  # a Text action space takes the reply itself
        if self.names:
            found = re.findall(r"\b(" + "|".join(self.names) + r")\b", action.lower())
            if found:
                return self.names[found[-1]]
        number = parse_last_number(action)
        return number if isinstance(number, int) and number in self.valid else None

    def _success(self, reward: float, terminated: bool, truncated: bool) -> bool:
        rule = self.known.success if self.known else "win"
        if rule == "goal":
            return terminated
        if rule == "survive":
            return truncated and not terminated
        return terminated and reward > 0


def _reply(message: dict[str, Any]) -> str | list[dict[str, Any]]:
    """A step's observation: the text alone as before, or the message whose parts hold the frame."""
    return message["content"] if isinstance(message["content"], str) else [message]


def make_env(uri: str, invalid_action_reward: float = -1.0, **kwargs: Any) -> GymnasiumEnv:
    """uri: the env id, optionally with ?render=image (see the module's docstring)."""
    if isinstance(invalid_action_reward, bool) or not isinstance(invalid_action_reward, (int, float)):
        raise UsageError(f"env.kwargs.invalid_action_reward: expected a number, got {invalid_action_reward!r}.")
    name, image = uri_options(uri)
    try:
        spec = gymnasium.spec(name)
        if image:
            if kwargs.get("render_mode", "rgb_array") != "rgb_array":
                raise UsageError(
                    f"gymnasium:{uri}: render=image makes the env with render_mode rgb_array; "
                    f"drop env.kwargs.render_mode ({kwargs['render_mode']!r})."
                )
            if "rgb_array" not in _render_modes(spec):
                raise UsageError(f"gymnasium:{name} has no rgb_array render mode, so render=image cannot show it.")
            kwargs["render_mode"] = "rgb_array"
            # pygame (the toy-text envs draw with it) greets on stdout when imported: not into --json output.
            os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
        elif "render_mode" not in kwargs and "ansi" in _render_modes(spec):
            kwargs["render_mode"] = "ansi"
        env = gymnasium.make(name, **kwargs)
    except gymnasium.error.Error as exc:
        raise UsageError(f"gymnasium:{name}: {exc}") from None
    except TypeError as exc:
        raise UsageError(f"env.kwargs do not fit gymnasium:{name}: {exc}") from None
    if not is_text_representable(env.observation_space) and not image:
        env.close()
        raise UsageError(
            f"gymnasium:{name} observations are {env.observation_space}, which cannot be written as text "
            "(images and large arrays are not supported). Supported: Discrete, Text, 1-D vectors of at most "
            f"{MAX_VECTOR} numbers, and Tuple/Dict of those; or add ?render=image to show the env's frames."
        )
    if not isinstance(env.action_space, (spaces.Discrete, spaces.Text)):
        env.close()
        raise UsageError(
            f"gymnasium:{name} actions are {env.action_space}; only Discrete (an index or a name) "
            "and Text actions can be chosen by a text reply."
        )
    return GymnasiumEnv(name, env, invalid_action_reward, image)


def uri_options(uri: str) -> tuple[str, bool]:
    """<EnvId>[?render=text|image] -> (the env id, whether frames are shown as images)."""
    name, _, query = uri.partition("?")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"render"})
    if unknown:
        raise UsageError(f"gymnasium:{uri}: unknown option {unknown[0]!r}; the one option is render=text|image.")
    render = options.get("render", "text")
    if render not in RENDERS:
        raise UsageError(f"gymnasium:{uri}: render must be text or image, got {render!r}.")
    return name, render == "image"


def _render_modes(spec: gymnasium.envs.registration.EnvSpec) -> list[str]:
    """The env class's render modes, read without building it (ansi renders are what an agent can read)."""
    entry_point = spec.entry_point
    if isinstance(entry_point, str):
        creator: Any = gymnasium.envs.registration.load_env_creator(entry_point)
    else:
        creator = entry_point
    return list(getattr(creator, "metadata", {}).get("render_modes", []))
