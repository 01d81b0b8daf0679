"""Processor: one short LLM or tool step per monologue line.

``app.register`` builds one :class:`~services.processor.processor.Processor` per process, with
what its steps share passed in (the tool dispatch, the open calls, the model calls in flight,
the conversation tails); nothing mutable lives at module level. What a line sent while a step
is pending does is decided by the join's :class:`~yoke.runtime.while_busy.WhileBusyPolicy`
alone, which the steps, the model call and the look at arriving deliveries ask. Each module is
a section of docs/architecture.md:

- ``processor``: the decision tree (``Processor.step``, ``Processor.answer_tool_results``);
- ``step``: which lines start a step, the window it reads, its output;
- ``tool_rounds``: running a round's calls, the doom-loop guard, a round ended by a stop,
  what a step decides while a round is open;
- ``inference``: the model call, its draft and activity hints, its cancel;
- ``commands``: slash commands and ``/stop``;
- ``notices``: what a step that ends without an answer leaves for operators and people;
- ``app``: the wiring (``register``).

Nothing outside the processor imports it but ``__main__`` (``app.register``); tests drive its
steps through ``Processor``.
"""
