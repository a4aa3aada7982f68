"""What a user watches: the widget panel and its text fallback, charts, rank-0 output,
and the terminal model that renders progress bars.

Imports only ``_wire``.
"""
