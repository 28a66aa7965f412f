"""The edit workload of `python -m cadenza.bench.features.speculative`: a document and a small change to make
to it, the answer being the whole document again, changed. This is what prompt lookup (`ngram`) and
`suffix` are for: an answer that repeats much of its prompt.

Thirteen tasks over prose (spelling fixes), code (Python, JavaScript, SQL), markup (HTML) and data
(JSON, YAML). Each answer may run to a quarter more than its document plus 16 tokens: an edit is
about as long as what it edits, and the cap keeps a small model that loops after the document from
turning the workload into repetition (the random workload's case).
"""

from __future__ import annotations

from dataclasses import dataclass

PROSE = (
    "The comittee met on tuesday to discus the new budjet for the libary. Several members argued that "
    "the funds for new books should be increased, while others beleived that the building itself needed "
    "repairs first. After a long debate, they agreed to split the money evenly betwen the two goals and "
    "to revisit the question next year.",
    "Our hiking trip started early in the moring. We packed sandwitches, water and a map, and followed "
    "the river trail untill it reached the old bridge. From there the path climbed steeply through the "
    "forrest, and by noon we could see the whole valley bellow us, with the village roofs shining in "
    "the sun.",
    "To install the software, first download the latest relase from the website. Unzip the archive into "
    "a folder of your choise, then open a terminal in that folder and run the setup script. The script "
    "will ask for a few settings; the defaults are fine for most users. When it finishs, restart your "
    "computer.",
)

SUMMARIZE = '''def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("valid"):
            total += record["amount"]
            count += 1
    if count == 0:
        return None
    average = total / count
    return {"total": total, "count": count, "average": average}
'''

RENDER_LIST = '''function renderList(items) {
  var list = document.createElement("ul");
  for (var i = 0; i < items.length; i++) {
    var item = document.createElement("li");
    item.textContent = items[i].name;
    list.appendChild(item);
  }
  return list;
}
'''

TODO_LIST = '''import json
from pathlib import Path


class TodoList:
    def __init__(self, path):
        self.path = Path(path)
        self.items = []
        if self.path.exists():
            self.items = json.loads(self.path.read_text())

    def add(self, title):
        self.items.append({"title": title, "done": False})
        self.save()

    def complete(self, index):
        self.items[index]["done"] = True
        self.save()

    def pending(self):
        return [item for item in self.items if not item["done"]]

    def save(self):
        self.path.write_text(json.dumps(self.items, indent=2))
'''

USERS = '''{
  "users": [
    {"id": 1, "name": "Alice", "email": "alice@example.com", "role": "admin"},
    {"id": 2, "name": "Bob", "email": "bob@example.com", "role": "editor"},
    {"id": 3, "name": "Carol", "email": "carol@example.com", "role": "viewer"}
  ]
}'''

SERVER_CONFIG = '''server:
  host: 0.0.0.0
  port: 8080
  workers: 4
database:
  url: postgres://db.internal:5432/app
  pool_size: 10
logging:
  level: info
  format: json
'''

BOOKS_PAGE = '''<!DOCTYPE html>
<html>
<head>
  <title>My Page</title>
  <link rel="stylesheet" href="style.css">
</head>
<body>
  <h1>Welcome to my page</h1>
  <p>This is a simple page with a list of my favourite books.</p>
  <ul>
    <li>The Hobbit</li>
    <li>Pride and Prejudice</li>
    <li>To Kill a Mockingbird</li>
  </ul>
</body>
</html>
'''

ORDERS_QUERY = '''SELECT customers.name, orders.id, orders.total
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.total > 100
ORDER BY orders.total DESC;
'''


@dataclass(frozen=True, slots=True)
class EditTask:
    kind: str  # prose, code, markup or data
    instruction: str
    document: str

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": f"{self.instruction}\n\n{self.document}"}]

    def max_tokens(self, tokenizer) -> int:
        return len(tokenizer.encode(self.document)) * 5 // 4 + 16


TASKS = (
    *(
        EditTask("prose", "Rewrite the following text with the spelling mistakes fixed. Reply with the corrected text only.", p)
        for p in PROSE
    ),
    EditTask("code", "Rename the variable `total` to `amount_sum` in this Python function. Reply with the whole function only.", SUMMARIZE),
    EditTask("code", "Add a docstring to this Python function. Reply with the code only.", SUMMARIZE),
    EditTask("code", "Rewrite this JavaScript function to use `let` instead of `var`. Reply with the code only.", RENDER_LIST),
    EditTask("code", "Add a method `clear` that empties the list and saves it to this class. Reply with the whole file.", TODO_LIST),
    EditTask("code", "Fix the typo in this Python code and reply with the corrected code.", TODO_LIST.replace("pending", "pendng")),
    EditTask("code", "Add orders.created_at to the selected columns of this query. Reply with the query only.", ORDERS_QUERY),
    EditTask("data", 'Change Bob\'s role to "admin" in this JSON. Reply with the full JSON only.', USERS),
    EditTask("data", "Change the port to 9090 in this YAML config. Reply with the whole file only.", SERVER_CONFIG),
    EditTask("markup", 'Add "1984" to the list of books in this HTML page. Reply with the full page.', BOOKS_PAGE),
    EditTask("markup", 'Change the page title to "Books" in this HTML. Reply with the whole HTML.', BOOKS_PAGE),
)  # fmt: skip
