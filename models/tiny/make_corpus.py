#!/usr/bin/python3
"""Writes models/tiny/corpus.txt: the small original English corpus the tiny test
model's sentencepiece tokenizer is trained on.

Standard library only and deterministic (own splitmix64 PRNG), so the committed
corpus.txt can be regenerated bit for bit:  /usr/bin/python3 make_corpus.py > corpus.txt
One sentence or short paragraph per line (spm_train reads lines; each stays far
below its 4192-byte max_sentence_length).
"""

import sys

MASK64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n):
        return self.next_u64() % n

    def pick(self, items):
        return items[self.below(len(items))]


PROSE = [
    "The old oak at the bottom of the garden has watched three generations of children climb its lower branches.",
    "In spring the river rises with snowmelt, and the stepping stones disappear under a skin of brown water.",
    "A computer does exactly what it is told, which is both its great virtue and its most annoying habit.",
    "Grandmother kept her recipes in a tin box: flour-dusted cards, each one stained by the dish it described.",
    "The maple leaves turned first, then the birches, and by November only the stubborn beech held on.",
    "Water finds the lowest path; a river is simply the memory of every rain that fell upstream.",
    "She wrote the program on a Sunday afternoon, tested it on Monday, and spent Tuesday finding the bug.",
    "To make bread you need patience more than skill: the dough rises when it is ready, not when you are.",
    "Roots spread beneath the lawn like a second, hidden tree, drinking from soil no one ever sees.",
    "The ferry crossed the estuary twice an hour, its engine humming a low note that carried over the mud flats.",
    "A binary tree has at most two children per node; a family tree, unfortunately, has no such limit.",
    "Tomatoes want sun, basil wants warmth, and the gardener wants rain on the days she forgets to water.",
    "Numbers are patient companions. Seven stays seven whether you count apples, days, or stars.",
    "The kettle whistled, the toast jumped, and the cat, unimpressed, went back to sleep on the radiator.",
    "At the source the river is narrow enough to step across; at the sea it is wider than a town.",
    "Every compiler error is a small letter from the machine, written in a language only half translated.",
    "The willow leaned over the pond as if it had dropped something precious into the water long ago.",
    "Soup improves overnight. Nobody quite knows why, but the onions and the thyme seem to talk in the dark.",
    "He planted an apple seed in 1987; the tree now gives more fruit than the whole street can eat.",
    "Memory in a computer is a long row of numbered boxes, and every program is a story about moving things between them.",
    "Herons stand in the shallows for an hour without moving, then strike faster than the eye can follow.",
    "The recipe said a pinch of salt, but her pinch and his pinch were clearly measured in different units.",
    "A good index turns a slow search into a fast one; a good garden path does the same for the weeds.",
    "By the third bend the river slows, widens, and lets the silt settle into a crescent of pale sand.",
    "The network went down at 3:14 in the morning, which is, of course, the only time networks ever go down.",
    "Pine needles make a soft floor; walking through the forest after rain feels like walking on a sponge.",
    "Knead, fold, rest, repeat. The rhythm of baking is older than any clock in the kitchen.",
    "Prime numbers thin out as you climb, yet there is always another one waiting beyond the last.",
    "The lighthouse keeper counted the ships: forty-two in the summer, nine in the winter, one in the storm.",
    "Cache misses are to a processor what forgotten shopping lists are to a cook: a second trip to the store.",
    "Moss grows on the north side of the wall, where the sun is a rumour and the stone stays damp all year.",
    "When the bees found the lavender, the whole border hummed like a machine that had learned to sing.",
    "A fallen tree across the river becomes a bridge for squirrels and a dam for leaves.",
    "The spreadsheet had 12,480 rows, and somewhere among them was the single cell that broke everything.",
    "Cinnamon, cardamom, clove: the spice drawer smelled of distant markets and winter evenings.",
    "Branches fork and fork again, each choosing a direction toward the light, none of them looking back.",
    "Debugging is detective work in which you are also, frequently, the culprit.",
    "Rain drummed on the greenhouse roof while the seedlings, safe inside, stretched toward the gray sky.",
    "Half a cup of sugar, two eggs, a spoon of vanilla; the cake is simple, and that is its secret.",
    "The river delta splits into a hundred channels, like a tree drawn upside down across the map.",
]

DIALOGUE = [
    ('"Is the oven hot yet?" asked Mara.', '"Give it ten more minutes," said Tom, "and stop opening the door."'),
    ('"Why is the build failing?" asked Priya.', '"Because someone renamed the header and forgot the tests," said Leo.'),
    ('"How deep is the river here?" asked the boy.', '"Deep enough to lose a boot, shallow enough to find it," said the ferryman.'),
    ('"Which tree is the oldest?" asked Ana.', '"The yew by the church; it was old when the church was new," said the gardener.'),
    ('"Can you count to a hundred in French?" asked Sam.', '"Only to soixante-dix, then I get confused," laughed Claire.'),
    ('"Did you water the beans?" asked Grandpa.', '"Yesterday, and the day before, and they still look sad," said June.'),
    ('"What does this function return?" asked the reviewer.', '"A list, unless it is empty, in which case it returns nothing," said the author.'),
    ('"Shall we walk along the river or through the woods?" asked Ines.', '"The woods; the river path is still flooded," said Karl.'),
    ('"Is it done?" asked the child, peering at the pot.', '"Soup is never done; it is only ready," said her father.'),
    ('"How many servers do we need?" asked the manager.', '"Four for the load, a fifth for when one of the four catches fire," said the engineer.'),
]

NAMES = ["Mara", "Tom", "Priya", "Leo", "Ana", "Sam", "Claire", "June", "Ines", "Karl", "Omar", "Yuki",
         "Beatrice", "Felix", "Rosa", "Hugo"]
TREES = ["oak", "maple", "birch", "willow", "cedar", "pine", "beech", "apple tree", "cherry tree",
         "chestnut", "elm", "sycamore", "hawthorn", "olive tree"]
PLACES = ["by the river", "in the garden", "behind the library", "on the hill", "near the bridge",
          "at the edge of the forest", "beside the pond", "along the canal", "in the orchard",
          "under the old wall"]
ACTIONS = ["planted", "pruned", "measured", "photographed", "drew", "climbed", "watered", "mulched",
           "sketched", "counted the rings of"]
WEATHER = ["a cold clear morning", "a wet afternoon", "a windy evening", "a quiet Sunday",
           "the first warm day of May", "a foggy dawn", "a hot July noon", "a gray October day"]
DISHES = ["lentil soup", "apple pie", "vegetable curry", "bread rolls", "pancakes", "risotto",
          "tomato sauce", "onion tart", "fish stew", "oat cookies", "potato salad", "plum jam"]
INGREDIENTS = ["flour", "butter", "onions", "garlic", "carrots", "rice", "milk", "eggs", "sugar",
               "salt", "lentils", "tomatoes", "potatoes", "apples", "honey", "lemons", "pepper",
               "olive oil", "thyme", "parsley"]
UNITS = ["grams of", "cups of", "spoons of", "pinches of", "handfuls of", "litres of"]
VERBS_COOK = ["Chop", "Stir", "Simmer", "Whisk", "Fold", "Roast", "Slice", "Season", "Bake", "Grate"]
COMPUTING = ["the scheduler", "the compiler", "the database", "the cache", "the network card",
             "the parser", "the kernel", "the tokenizer", "the web server", "the test suite",
             "the garbage collector", "the load balancer"]
COMPUTING_EVENTS = ["restarted after a timeout", "reported 3 warnings", "finished in 412 ms",
                    "ran out of memory", "rejected a malformed request", "rebuilt its index",
                    "passed every check", "logged an unexpected error", "doubled its throughput",
                    "waited for a lock", "dropped 17 packets", "recovered from a crash"]
RIVERS = ["The river", "The stream", "The brook", "The canal", "The estuary", "The creek"]
RIVER_EVENTS = ["carried a raft of leaves past the mill", "froze along its edges overnight",
                "rose two feet after the storm", "ran clear over the pebbles",
                "turned the colour of tea", "split around a small island of reeds",
                "sang under the bridge", "flooded the lower meadow"]

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]


def number_words(n):
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    rest = n % 100
    head = ONES[n // 100] + " hundred"
    return head if rest == 0 else head + " and " + number_words(rest)


def garden_journal(rng):
    day = 1 + rng.below(28)
    month = rng.pick(MONTHS)
    year = 1990 + rng.below(35)
    who = rng.pick(NAMES)
    return (f"{month} {day}, {year}: On {rng.pick(WEATHER)}, {who} {rng.pick(ACTIONS)} the "
            f"{rng.pick(TREES)} {rng.pick(PLACES)}.")


def recipe(rng):
    dish = rng.pick(DISHES)
    parts = []
    for _ in range(2 + rng.below(3)):
        parts.append(f"{1 + rng.below(9)} {rng.pick(UNITS)} {rng.pick(INGREDIENTS)}")
    minutes = 5 * (2 + rng.below(18))
    return (f"For the {dish}, take {', '.join(parts[:-1])} and {parts[-1]}. "
            f"{rng.pick(VERBS_COOK)} gently, then cook for {minutes} minutes at "
            f"{150 + 10 * rng.below(8)} degrees.")


def computing_log(rng):
    h, m, s = rng.below(24), rng.below(60), rng.below(60)
    return (f"[{h:02d}:{m:02d}:{s:02d}] {rng.pick(COMPUTING).capitalize()} "
            f"{rng.pick(COMPUTING_EVENTS)}; {rng.pick(COMPUTING)} {rng.pick(COMPUTING_EVENTS)}.")


def arithmetic(rng):
    a, b = 2 + rng.below(19), 2 + rng.below(19)
    kind = rng.below(3)
    if kind == 0:
        return f"{number_words(a).capitalize()} times {number_words(b)} is {number_words(a * b)} ({a} x {b} = {a * b})."
    if kind == 1:
        return f"If you add {a} to {b * 7}, you get {a + b * 7}; subtract {b} and {a + b * 6} remains."
    return f"{a * b} divided by {b} equals {a}, and {a} squared is {a * a}."


def river(rng):
    return f"{rng.pick(RIVERS)} {rng.pick(RIVER_EVENTS)}, and {rng.pick(NAMES)} watched it {rng.pick(PLACES)}."


def main():
    rng = SplitMix64(20240611)
    lines = []
    generators = [garden_journal, recipe, computing_log, arithmetic, river]
    for i, paragraph in enumerate(PROSE):
        lines.append(paragraph)
        if i % 4 == 0:
            question, answer = DIALOGUE[(i // 4) % len(DIALOGUE)]
            lines.append(question)
            lines.append(answer)
        for _ in range(6):
            lines.append(generators[rng.below(len(generators))](rng))
    for n in range(0, 1000, 37):
        lines.append(f"{n} is written as {number_words(n)}; {n + 1} comes next.")
    while sum(len(line) + 1 for line in lines) < 32 * 1024:
        lines.append(generators[rng.below(len(generators))](rng))
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
