"""Input-grounded chat prompts: the answer copies most of the prompt, with one small change.

Rewrite-this-code and repeat-this-list requests are where n-gram (prompt lookup) speculation
pays: most answer tokens already occurred in the prompt. These fixed prompts are the workload
the speculative decoding benchmark measures it on (scripts/bench_spec_decode.py, and
`deepinfer bench serve --dataset input-grounded`). They are constants, never generated, so
every run and every system sees exactly the same text.
"""

from __future__ import annotations


def _task(instruction: str, body: str) -> str:
    return f"{instruction}\n\n{body.strip()}"


_RENAME_FUNCTION = '''
def summarize_scores(scores, threshold):
    """Return the number of passing scores, their mean and the best one."""
    x = 0
    total = 0.0
    best = None
    for score in scores:
        if score is None:
            continue
        if score < threshold:
            continue
        x += 1
        total += score
        if best is None or score > best:
            best = score
    if x == 0:
        return 0, 0.0, None
    mean = total / x
    return x, mean, best


def print_summary(scores, threshold=50):
    x, mean, best = summarize_scores(scores, threshold)
    print(f"{x} passing, mean {mean:.1f}, best {best}")
'''

_ADD_TYPE_HINTS = '''
def merge_intervals(intervals):
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_covered(intervals):
    covered = 0
    for start, end in merge_intervals(intervals):
        covered += end - start
    return covered
'''

_FIX_OFF_BY_ONE = '''
def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    running = sum(values[:window])
    averages.append(running / window)
    for i in range(window, len(values) - 1):
        running += values[i] - values[i - window]
        averages.append(running / window)
    return averages


def smooth(series, window=3):
    if len(series) < window:
        return list(series)
    return moving_average(series, window)
'''

_JS_RENAME = '''
function groupByCategory(items) {
  const groups = {};
  for (const item of items) {
    const key = item.category || "other";
    if (!groups[key]) {
      groups[key] = [];
    }
    groups[key].push(item);
  }
  return groups;
}

function countByCategory(items) {
  const groups = groupByCategory(items);
  const counts = {};
  for (const key of Object.keys(groups)) {
    counts[key] = groups[key].length;
  }
  return counts;
}
'''

_SQL_QUERY = '''
SELECT customers.id,
       customers.name,
       customers.city,
       COUNT(orders.id) AS order_count,
       SUM(orders.total) AS total_spent,
       MAX(orders.created_at) AS last_order
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.status = 'shipped'
  AND orders.created_at >= '2024-01-01'
GROUP BY customers.id, customers.name, customers.city
HAVING COUNT(orders.id) >= 3
ORDER BY total_spent DESC
LIMIT 20;
'''

_YAML_CONFIG = '''
server:
  host: 0.0.0.0
  port: 8080
  workers: 4
  timeout_seconds: 30
database:
  host: db.internal
  port: 5432
  name: inventory
  user: app
  pool_size: 10
cache:
  enabled: true
  ttl_seconds: 300
  max_entries: 5000
logging:
  level: info
  format: json
  file: /var/log/inventory/app.log
'''

_SHOPPING_LIST = '''
1. Two litres of whole milk
2. A loaf of wholemeal bread
3. Six free-range egss
4. A bag of basmati rice
5. Three red peppers
6. A jar of peanut butter
7. Four bananas
8. A block of cheddar cheese
9. A bottle of olive oil
10. Two tins of chopped tomatoes
11. A box of green tea
12. A bunch of fresh coriander
'''

_MEETING_PARAGRAPH = '''
The quarterly planning meeting will take place on Monday at ten in the morning in the large
conference room on the third floor. Please bring your team's draft roadmap and a short list of
the risks you see for the next three months. On Monday we will first review last quarter's
results, then each team lead will have ten minutes to present. Lunch will be provided after the
session, and the afternoon on Monday is reserved for smaller working groups. If you cannot
attend on Monday, send your slides to the programme office by Friday evening.
'''

_EMAIL = '''
Dear Ms Patel,

Thank you for your order of the oak dining table and six matching chairs. We are pleased to
confirm that all items are in stock and will be delivered to your home address on Thursday
between nine and twelve. Our two delivery drivers will carry the furniture inside and assemble
the table in the room of your choice. Please make sure that someone is at home to receive the
delivery and that the entrance is clear. If you need to change the delivery date, reply to this
email or call our customer service team at least two days in advance.

Kind regards,
Daniel Brooks
Customer Service, Northwood Furniture
'''

_RECIPE = '''
Ingredients:
- 200 g spaghetti
- 2 tablespoons olive oil
- 3 cloves of garlic, thinly sliced
- 1 red chilli, finely chopped
- 400 g tin of chopped tomatoes
- 1 teaspoon sugar
- salt and black pepper
- a handful of fresh basil leaves
- 30 g grated parmesan

Method:
1. Bring a large pan of salted water to the boil and cook the spaghetti for ten minutes.
2. Warm the oil in a frying pan and fry the garlic and chilli for one minute.
3. Add the tomatoes and sugar and simmer for fifteen minutes.
4. Season the sauce with salt and pepper.
5. Drain the pasta, toss it with the sauce and serve with basil and parmesan.
'''

_CSV_TABLE = '''
city,country,population,area_km2
Lisbon,Portugal,545000,100
Madrid,Spain,3300000,604
Paris,France,2100000,105
Berlin,Germany,3700000,891
Vienna,Austria,1900000,415
Prague,Czech Republic,1300000,496
Warsaw,Poland,1800000,517
Budapest,Hungary,1700000,525
Rome,Italy,2800000,1285
Athens,Greece,660000,39
Dublin,Ireland,590000,118
Oslo,Norway,700000,454
'''

_JSON_RECORD = '''
{
  "id": 48213,
  "name": "Wireless Keyboard",
  "brand": "Keystone",
  "price": 49.99,
  "currency": "EUR",
  "in_stock": true,
  "stock_count": 132,
  "colours": ["black", "white", "grey"],
  "dimensions": {"width_mm": 440, "depth_mm": 130, "height_mm": 25},
  "battery": {"type": "AA", "count": 2, "life_months": 12},
  "warranty_years": 2,
  "tags": ["office", "bluetooth", "quiet keys"]
}
'''

_POEM = '''
The river runs beneath the hill,
The mill wheel turns, the air is still,
The swallows dip above the reeds,
The farmer walks among his seeds.
The evening bell rings out the hour,
The bee goes home from every flower,
The lamps are lit along the lane,
And slowly comes the summer rain.
The children run in from the street,
With muddy hands and tired feet,
The kettle sings, the fire is bright,
And all the valley says goodnight.
'''

_STEPS = '''
1. Unplug the printer and wait one minute.
2. Open the front cover and remove the toner cartridge.
3. Gently shake the cartridge from side to side five times.
4. Check the paper tray for torn sheets and remove them.
5. Put the cartridge back until it clicks into place.
6. Close the front cover.
7. Plug the printer in and switch it on.
8. Wait for the green light to stop blinking.
9. Print a test page from the settings menu.
10. If the page is still faint, replace the toner cartridge.
'''

_HTML_SNIPPET = '''
<nav class="main-menu">
  <ul>
    <li><a href="/">Home</a></li>
    <li><a href="/products">Products</a></li>
    <li><a href="/pricing">Pricing</a></li>
    <li><a href="/blog">Blog</a></li>
    <li><a href="/about">About us</a></li>
    <li><a href="/careers">Careers</a></li>
    <li><a href="/contact">Contact</a></li>
  </ul>
</nav>
<footer class="site-footer">
  <p>Copyright 2024 Example Ltd. All rights reserved.</p>
  <p><a href="/privacy">Privacy policy</a> | <a href="/terms">Terms of use</a></p>
</footer>
'''

_SCHEDULE = '''
08:30  Registration and coffee
09:00  Welcome address by the conference chair
09:20  Keynote: Building reliable data pipelines
10:10  Talk: Testing machine learning systems
10:50  Coffee break
11:10  Talk: Lessons from a year of on-call
11:50  Panel: Open source in the enterprise
12:40  Lunch
13:40  Workshop: Writing clear technical documents
15:00  Talk: Scaling a small team
15:40  Closing remarks
'''

GROUNDED_PROMPTS: tuple[str, ...] = (
    _task("Rewrite this Python code with one change: rename the variable `x` to `count`. "
          "Reply with the code only.", _RENAME_FUNCTION),
    _task("Add type hints to every function in this Python code and change nothing else. "
          "Reply with the code only.", _ADD_TYPE_HINTS),
    _task("This Python function skips the last window because of an off-by-one error in its "
          "loop. Reply with the corrected code only.", _FIX_OFF_BY_ONE),
    _task("Rewrite this JavaScript code with one change: rename the function `groupByCategory` "
          "to `groupItems` everywhere. Reply with the code only.", _JS_RENAME),
    _task("Repeat this SQL query exactly, but change the limit from 20 to 50. Reply with the "
          "query only.", _SQL_QUERY),
    _task("Copy this YAML configuration and change the server port from 8080 to 9090. Keep "
          "everything else the same.", _YAML_CONFIG),
    _task("Repeat the following shopping list exactly, but fix item 3, which is misspelled.",
          _SHOPPING_LIST),
    _task("Copy this paragraph and change 'Monday' to 'Tuesday' everywhere.", _MEETING_PARAGRAPH),
    _task("Copy this email exactly, but change the delivery day from Thursday to Saturday.",
          _EMAIL),
    _task("Repeat this recipe exactly, but double the amount of spaghetti.", _RECIPE),
    _task("Repeat this CSV table exactly, but change the population of Athens to 640000.",
          _CSV_TABLE),
    _task("Repeat this JSON object exactly, but set the price to 44.99.", _JSON_RECORD),
    _task("Copy this poem exactly, but replace the word 'swallows' with 'martins'.", _POEM),
    _task("Repeat these printer instructions exactly, but make step 1 say 'two minutes' "
          "instead of 'one minute'.", _STEPS),
    _task("Repeat this HTML exactly, but change the copyright year from 2024 to 2025.",
          _HTML_SNIPPET),
    _task("Copy this conference schedule exactly, but move lunch from 12:40 to 12:30.",
          _SCHEDULE),
)
