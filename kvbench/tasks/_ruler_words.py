"""Word lists for kvbench's RULER generators (:mod:`kvbench.tasks.ruler`).

RULER draws needle keys as ``adjective-noun`` pairs and the common-word list from the ``wonderwords``
package's English lists; kvbench ships its own short lists instead (written for kvbench, everyday English
words of four or more letters), so generation needs no extra package. Words that occur inside another
word of the lists are dropped when the lists are read (:data:`WORDS`), so a substring match on one word
can never be satisfied by another.
"""

from __future__ import annotations

ADJECTIVES = """
able acid aged alert alive ample angry ashen awake aware bald bare basic bitter blank bleak blind blond
bold brave brief bright brisk broad brown busy calm candid chilly civil clean clear clever close cloudy
coarse cold cool cosy crisp cruel curly curved damp dark dear deep dense dirty dizzy dull dusty eager
early eastern easy elder empty equal even exact faint fair false famous fancy fast fierce final fine
firm flat fluffy fond formal frail free fresh friendly frozen funny fuzzy gentle giant gifted glad gloomy
golden grand gray great greedy green grim gritty gross guilty handy happy hard harsh hasty heavy hidden
high hollow honest huge humble hungry icy idle jolly juicy keen kind large late lazy lean legal level
light little lively local lonely long loose loud lovely loyal lucky lumpy mad major mellow merry mild
minor misty modern moist narrow nasty native neat nervous noble noisy normal numb odd orange plain
plump polite poor proud purple quick quiet rapid rare ready regal rich rigid ripe rocky rough round royal
rude rural rusty sacred salty sandy scarce secret sharp shiny short shy silent silky silly simple sleepy
slim slow small smooth snowy sober soft solid sour spare spicy steady steep sticky stiff still stormy
strict strong sunny super sweet swift tall tame tender thick thin tidy tiny tired total tough tricky
true ugly upset urban usual vague valid vast vivid warm weak weary wet whole wicked wide wild windy wise
witty wooden young zany zealous
"""

NOUNS = """
acorn actor album alley amber anchor angle ankle apple apron arch arena armor arrow attic auction autumn
avenue badge bagel bakery ballet bamboo banjo banner barn barrel basket beach beacon beard beaver bell
belt bench berry bicycle blanket blossom board bonnet border bottle boulder bowl bracelet branch bread
breeze brick bridge brook broom bubble bucket buffalo bugle bundle butter button cabin cable cactus
camel camera canal candle canoe canvas canyon carpet carrot castle cattle cellar chalk chapel cheese
cherry chimney circus cliff clock closet cloud clover coast cobweb collar comet compass cookie copper
coral corner cottage cotton county cradle crater crayon creek cricket crown crystal cupboard curtain
cushion dagger daisy desert diamond dinner dolphin donkey dragon drawer dream drum eagle easel elbow
engine envelope fabric falcon feather fence ferry fiddle field finger flame flute forest fountain fox
frame garden garlic gate glacier glove goose grape gravel guitar gull hammer harbor harp harvest hazel
helmet herb heron highway hill honey hook horizon horse island ivory jacket jungle kettle kitten ladder
lagoon lantern lemon letter lily lobster locket magnet mango maple marble market meadow melon mirror
mitten monkey moose mountain muffin museum needle nest nickel novel oasis ocean olive onion orchard
otter oven owl paddle palace panda parcel parrot pasture peach pebble pencil pepper piano pickle pillow
pirate planet plum pocket pond poppy potato prairie puppet quilt rabbit radio raft rainbow raven ribbon
riddle river robin rocket saddle sailor salmon sandal satchel scarf school scooter shadow shelf shovel
signal silver sketch sleigh slipper spider sponge squirrel stable statue stove street sugar summit
swan table teapot temple thimble thunder ticket tiger timber toast tomato tower tractor trumpet tulip
tunnel turkey turtle umbrella valley velvet village violin volcano wagon walnut walrus wardrobe weasel
whale wheat whistle willow window wizard wolf zebra
"""

VERBS = """
accept admire advise agree allow amuse annoy answer appear argue arrange arrive attach attend bake
balance bathe battle beam beg behave belong blink blush boast boil bolt bounce bow breathe bump bury
calculate carve cause charge chase cheer chew clap coach collect comb command compare complain confess
connect copy correct cough count crawl cross crush cycle dance decide deliver depend describe deserve
destroy develop divide double drag drain dress drift drop dust educate employ enjoy enter escape examine
excite expand explain fasten fetch file fill fix flash float flood flow fold follow force found frighten
gather gaze glow grab grease greet grin grip groan guard guess guide hammer hand hang happen harm hover
hunt hurry identify ignore imagine impress improve include inform inject invent invite itch jog juggle
kneel knit knock knot label land laugh launch learn lick list listen load lock march marry match measure
melt memorize milk mourn move muddle multiply murmur nail nest nod obey observe obtain offer open order
overflow pack paint park peel perform permit pinch plant play please plug point polish pour practise
pray preach precede prefer prepare present preserve press pretend prevent print produce promise protect
provide pull pump punch punish push question queue race rain reach realise receive record reduce reflect
refuse reign reject rejoice relax release remain remember remind remove repair repeat replace reply report
rescue retire return rhyme rinse risk rob rock roll rub ruin rule rush sail satisfy scatter scold scrape
scream screw scribble scrub seal search separate serve settle shade share shave shelter shiver shock shop
sigh sign signal sin sip ski skip slap slip slow smash smell smile smoke snatch sneeze sniff snore snow
soak soothe sound spare spark sparkle spell spill spoil spot spray sprout squash squeak squeal squeeze stain
stamp stare start stay steer step stir stitch stop store strap strengthen stretch strip stroke stuff subtract
succeed suck suffer suggest suit supply support suppose surprise surround suspect suspend switch
"""


def _words(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(w for w in text.split() if len(w) >= 4 and w.isalpha()))


def _no_inner(words: tuple[str, ...]) -> tuple[str, ...]:
    """Drop every word that occurs inside another (``lock`` inside ``locket``)."""
    return tuple(w for w in words if not any(w != o and w in o for o in words))


#: Every list word, none inside another, in a fixed order.
WORDS: tuple[str, ...] = _no_inner(_words(ADJECTIVES) + _words(NOUNS) + _words(VERBS))
#: Key material: adjective and noun lists with the inner words removed.
ADJECTIVE_WORDS: tuple[str, ...] = tuple(w for w in _words(ADJECTIVES) if w in set(WORDS))
NOUN_WORDS: tuple[str, ...] = tuple(w for w in _words(NOUNS) if w in set(WORDS))
