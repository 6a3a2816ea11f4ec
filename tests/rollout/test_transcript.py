"""The transcript: what each tool answer adds, as the policy sees it."""

from __future__ import annotations

from fleetroll.policies import AssistantTurn, ToolCall
from fleetroll.rollout.transcript import Transcript
from fleetroll.tools.session import ToolResult

IMAGE = "data:image/png;base64," + "A" * 64


def label_of_images_after(call: ToolCall) -> str:
    transcript = Transcript()
    transcript.add_prompt("Draw the chart.")
    transcript.add_turn(AssistantTurn(tool_calls=(call,)))
    transcript.add_answer(call, ToolResult(text="ok", images=(IMAGE,)))
    images = transcript.messages[-1]
    assert images["role"] == "user"
    assert images["content"][1] == {"type": "image_url", "image_url": {"url": IMAGE}}
    return str(images["content"][0]["text"])


def test_the_computer_tool_s_images_are_labelled_as_screenshots_after_its_action() -> None:
    call = ToolCall(id="call_0", name="computer", arguments={"action": "click"})

    assert label_of_images_after(call) == "Screenshot after computer (call_0):"


def test_another_tool_s_images_are_labelled_with_the_tool_not_as_a_screenshot() -> None:
    call = ToolCall(id="call_3", name="render_chart", arguments={"series": "revenue"})

    assert label_of_images_after(call) == "Image from render_chart (call_3):"


def test_the_transcript_flags_error_answers_by_the_tool_s_flag_not_by_their_text() -> None:
    transcript = Transcript()
    transcript.add_prompt("Check the ledger.")
    answers = [
        ToolResult(text="Error log: empty"),
        ToolResult(text="ledger locked", is_error=True),
    ]
    for n, answer in enumerate(answers):
        call = ToolCall(id=f"call_{n}", name="read_ledger")
        transcript.add_turn(AssistantTurn(tool_calls=(call,)))
        transcript.add_answer(call, answer)

    flagged = [
        m["content"]
        for i, m in enumerate(transcript.messages)
        if transcript.messages.is_error_answer(i)
    ]
    assert flagged == ["ledger locked"]


def test_an_agent_s_observations_keep_their_chat_fields_and_count_their_images() -> None:
    transcript = Transcript(max_images=1)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    transcript.add_observations(
        [
            {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "extra"},
            {"role": "user", "content": [{"type": "text", "text": "shot"}, image]},
            {"role": "system", "content": "the agent's own: not an observation"},
            {"role": "user", "content": [image]},
        ]
    )
    tool, first, second = transcript.messages
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    # Only the last image is kept (max_images), as for the built-in loop's answers.
    assert first["content"][1]["type"] == "text" and "omitted" in first["content"][1]["text"]
    assert second["content"] == [image]
