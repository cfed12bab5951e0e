import pytest

from tether.agent.parsers import get_parser


def test_hermes_extracts_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "query_inventory", "arguments": {"sku_id": "SKU-123"}}\n</tool_call>'
            '<tool_call>{"name": "check_refund_policy", "arguments": {"order_id": "O-1", "reason_code": "DAMAGED"}}'
            '</tool_call>')
    turn = get_parser("hermes")(text)
    assert turn.content == "Let me check."
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [
        ("query_inventory", {"sku_id": "SKU-123"}, "call_0"),
        ("check_refund_policy", {"order_id": "O-1", "reason_code": "DAMAGED"}, "call_1"),
    ]
    assert turn.errors == []


@pytest.mark.parametrize("body, reason", [
    ('{"name": "x", "arguments": {', "invalid JSON"),
    ('["x"]', "JSON object"),
    ('{"arguments": {}}', "'name'"),
    ('{"name": "x", "arguments": [1]}', "'arguments' must be"),
    ('{"name": "x", "arguments": "{bad"}', "not valid JSON"),
])
def test_hermes_malformed_calls_become_errors(body, reason):
    turn = get_parser("hermes")(f"<tool_call>{body}</tool_call>")
    assert turn.calls == []
    assert len(turn.errors) == 1 and reason in turn.errors[0].reason


def test_hermes_arguments_as_json_string_and_unterminated_block():
    turn = get_parser("hermes")('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call> ok '
                                '<tool_call>{"name"')
    assert [(c.name, c.arguments) for c in turn.calls] == [("f", {"a": 1})]
    assert [e.reason for e in turn.errors] == ["unterminated <tool_call> block"]
    assert turn.content == "ok"


def test_plain_text_has_no_calls():
    turn = get_parser("hermes")("  Your refund of 12.50 is approved.  ")
    assert turn.calls == [] and turn.errors == [] and turn.content == "Your refund of 12.50 is approved."


def test_function_call_parser_accepts_bare_and_fenced_json():
    p = get_parser("function_call_parser")
    bare = p('{"name": "query_inventory", "parameters": {"sku_id": "SKU-1"}}')
    assert [(c.name, c.arguments) for c in bare.calls] == [("query_inventory", {"sku_id": "SKU-1"})]
    assert bare.content == ""
    fenced = p('I will look.\n```json\n{"name": "query_inventory", "arguments": {"sku_id": "SKU-2"}}\n```')
    assert [(c.name, c.arguments) for c in fenced.calls] == [("query_inventory", {"sku_id": "SKU-2"})]
    assert fenced.content == "I will look."
    tagged = p('<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert [c.name for c in tagged.calls] == ["a"]
    assert p("just words").content == "just words"


def test_unknown_parser_names_the_registered_ones():
    with pytest.raises(KeyError, match="function_call_parser"):
        get_parser("nope")


def test_pythonic_reads_a_list_of_keyword_calls():
    from tether.agent.parsers import get_parser

    parse = get_parser("pythonic")
    turn = parse(' [query_inventory(sku_id="SKU-9"), check_refund_policy(order_id="o-1", reason_code=3)] ')
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [
        ("query_inventory", {"sku_id": "SKU-9"}, "call_0"),
        ("check_refund_policy", {"order_id": "o-1", "reason_code": 3}, "call_1")]
    assert turn.content == "" and turn.errors == []
    # prose, prose in brackets, and hermes blocks are content: no call, no error
    for text in ("Your refund is on its way.", "[see the order above]",
                 '<tool_call>{"name": "query_inventory", "arguments": {"sku_id": "SKU-9"}}</tool_call>'):
        turn = parse(text)
        assert turn.calls == [] and turn.errors == [] and turn.content == text
    # positional or non-literal arguments are errors the model sees
    assert "by keyword" in parse('[query_inventory("SKU-9")]').errors[0].reason
    assert "literals" in parse("[query_inventory(sku_id=open('x'))]").errors[0].reason
    assert "name(arg=value" in parse("[1, 2]").errors[0].reason
