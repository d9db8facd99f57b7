"""The account holder's usage dashboard (spec: "usage is shown in a dashboard"): a page, its
script and its styles, shipped in the package (`dashboard_assets/`) and served by page_files.

    GET /dashboard            the page: the holder types an API key
    GET /dashboard/app.js     reads GET /v2/account and /v2/account/usage with it; tables, and
                              charts drawn as inline SVG
    GET /dashboard/style.css

These routes serve the same bytes to everyone and never see a key: the page sends it only to the
account routes, which check it as they check any caller's.
"""

from __future__ import annotations

from typing import Final

from proxy.api.page_files import asset, doc, serve

_FOLDER: Final = "dashboard_assets"
PAGE: Final = asset(_FOLDER, "index.html", "text/html")
SCRIPT: Final = asset(_FOLDER, "app.js", "text/javascript")
STYLE: Final = asset(_FOLDER, "style.css", "text/css")

page: Final = serve(PAGE)
script: Final = serve(SCRIPT)
style: Final = serve(STYLE)

PAGE_DOC: Final = doc("The usage dashboard for account holders (reads /v2/account and "
                      "/v2/account/usage with the key typed into it)", "text/html", "dashboard")
SCRIPT_DOC: Final = doc("The usage dashboard's script", "text/javascript", "dashboard")
STYLE_DOC: Final = doc("The usage dashboard's styles", "text/css", "dashboard")
