"""The default calibration text of `lucy convert` (the importance matrix's input when no
--calibration FILE is given): a mix of prose, source code and chat turns.

Origin (docs/quantization.md): the prose, code and dialogue were written for this project and
ship under its license; the one quoted passage, Lincoln's Gettysburg Address (1863), is in the
public domain. It is not the evaluation text of benchmarks/quant_quality.py.
"""

DEFAULT_TEXT = r'''The harbour town woke slowly in winter. Before the first bus, the bakers had already lit
their ovens, and the smell of bread drifted down the narrow streets toward the water. A few
fishermen checked their nets by lamplight, talking in low voices about the weather, the price of
diesel and a cousin who had moved to the city and never written back. Nobody hurried. The tide
would come when it came, and the boats would leave when the sea allowed it.

Mara had lived there for thirty years and still counted the gulls on the church roof each
morning, a habit she had picked up from her grandmother. Seven meant a calm day; more than ten
meant a storm was coming, or so the old woman had claimed. Mara did not believe it, exactly, but
she had noticed that on the mornings she forgot to count, something usually went wrong.

Science begins with a question that can be checked. Why does ice float? Because water expands
as it freezes: the molecules settle into a lattice that takes up more room than the liquid, so a
cube of ice is less dense than the water around it. This small fact has large consequences.
Lakes freeze from the top down, the ice insulating the water below, and fish survive the winter
in the dark, cold but liquid depths. If ice sank, many lakes would freeze solid.

Four score and seven years ago our fathers brought forth on this continent, a new nation,
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we
are engaged in a great civil war, testing whether that nation, or any nation so conceived and so
dedicated, can long endure. We are met on a great battle-field of that war. We have come to
dedicate a portion of that field, as a final resting place for those who here gave their lives
that that nation might live. It is altogether fitting and proper that we should do this.

A budget is a plan for money that has not been spent yet. Write down what comes in each month,
then what must go out: rent, food, transport, the electricity bill. What remains can be split
between savings and the things that make life pleasant. The hard part is not the arithmetic but
the honesty; small purchases of 3.50 or 12.99 add up to 200 or 300 a month before anyone
notices. Review the numbers every few weeks and adjust them, rather than once a year.

def moving_average(values, window=3):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name: str, count: int = 1) -> None:
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name: str, count: int = 1) -> bool:
        have = self.items.get(name, 0)
        if have < count:
            return False
        self.items[name] = have - count
        return True


#include <stdio.h>
#include <stdlib.h>

static int compare(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int main(void) {
    int data[] = {42, 7, 19, 3, 88, 21};
    size_t n = sizeof data / sizeof data[0];
    qsort(data, n, sizeof data[0], compare);
    for (size_t i = 0; i < n; i++) printf("%d\n", data[i]);
    return 0;
}

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY spent DESC
LIMIT 10;

function debounce(fn, delay) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), delay);
  };
}

for f in *.log; do gzip -9 "$f" && echo "compressed $f"; done

User: Can you explain what a hash table is, in simple terms?
Assistant: Sure. A hash table stores values under keys, like a dictionary. It runs each key
through a hash function, which turns the key into a number, and uses that number to pick a slot
in an array. Looking a key up repeats the same calculation, so it takes about the same time no
matter how many items are stored. When two keys land in the same slot, the table keeps both, for
example in a short list, and checks them one by one.

User: What should I pack for a three-day hike in the mountains?
Assistant: Start with the essentials: a map and compass (or a charged GPS with spare batteries),
a headlamp, a first-aid kit, sun protection, and a knife. Bring layers rather than one heavy
coat: a base layer, a warm fleece and a waterproof shell. Plan about two litres of water per
person per day plus a way to purify more, and food with plenty of calories such as nuts, oats,
cheese and dried fruit. A light tent or bivvy, a sleeping bag rated for the night temperatures,
and a small stove complete the list. Tell someone your route and when you expect to return.

User: Translate "good morning, how are you?" into French and Spanish.
Assistant: French: "Bonjour, comment allez-vous ?" (or "comment ça va ?" among friends).
Spanish: "Buenos días, ¿cómo estás?" (or "¿cómo está usted?" to be formal).

User: My Python script says "IndexError: list index out of range". What does that mean?
Assistant: It means the code asked for a position that the list does not have. A list of three
items has positions 0, 1 and 2; asking for item 3 raises this error. Check the loop bounds: a
common cause is `for i in range(len(items) + 1)` or reading `items[i + 1]` on the last pass.
Printing `len(items)` and `i` just before the failing line usually shows the problem.

User: Write a haiku about autumn.
Assistant: Maple leaves let go,
a red path to the river;
the cold wind counts them.

The committee met on Tuesday to review the proposal for the new library. The architect
presented three designs: a glass pavilion facing the park, a renovated warehouse near the
station, and a smaller building that would share a site with the primary school. Costs ranged
from 4.2 to 6.8 million. Several members worried about heating the glass building in winter;
others pointed out that the warehouse needed a new roof and extensive work on its foundations.
After two hours of discussion, the committee asked for detailed estimates of running costs over
twenty years, including energy, maintenance and staffing, before taking a decision in March.

Photosynthesis turns light into chemical energy. In the leaves, chlorophyll absorbs mostly red
and blue light, which is why plants look green: that is the light they reflect. The energy
splits water molecules, releasing oxygen, and drives a cycle of reactions that builds sugars
from carbon dioxide taken from the air. Roughly speaking, six molecules of carbon dioxide and six
of water become one molecule of glucose and six of oxygen.

He opened the letter at the kitchen table. It was short, written in a careful, old-fashioned
hand: the house by the river had been sold, the furniture would be given away unless he wanted
any of it, and the key was with the neighbour, Mrs. Okafor, who had kept the garden alive all
summer. He read it twice, folded it along its creases, and sat for a long time looking at the
rain on the window, remembering the smell of the boathouse and his father's voice calling him in
for supper.
'''
