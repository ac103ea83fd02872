"""Tool calls: how tools reach the prompt, how the model's calls are constrained and parsed.

``spec`` holds a request's tools; ``formats`` knows each model family's call syntax
(its grammar and its parser); ``prompt`` writes tools and tool turns into the prompt;
``stream`` turns a choice's text into OpenAI's ``tool_calls`` deltas as it streams.
"""
